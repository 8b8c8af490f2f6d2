"""Pipelines on CUDA (gpu-marked: skip without the devices; the lead runs them on a GPU box,
e.g. `bash scripts/gpu/session.sh tests`):

- one device: a 1-stage pipeline engine (train_batch, the loss scaler, the global-norm
  clipping and the loss broadcast on CUDA tensors) trains GPT-lite with the per-step losses
  of plain torch on the CPU;
- two devices: the 2-stage job of test_pipe_parity.py over NCCL, where activations,
  gradients, shape headers and the abort notice travel as CUDA tensors through NCCL
  send/recv.

The reference trains on the CPU, so the tolerance is looser than the gloo runs' 1e-5 (CUDA
and CPU kernels round differently)."""
import pytest
import torch

from dist_harness import run_function
from test_pipe_parity import _pp2_worker, check_pp2, config, run_gptlite

NCCL = {"DSLAUNCH_TEST_BACKEND": "nccl"}
TOL = 1e-4
pytestmark = pytest.mark.gpu


def _pp1_worker():
    gas = 4
    return {"fp32": run_gptlite(1, 1, gas, config(gas)), "bf16": run_gptlite(1, 1, gas, config(gas, dtype="bf16"))}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_one_stage_pipeline_on_cuda_matches_unpipelined_training():
    (r,) = run_function(_pp1_worker, nprocs=1, timeout=280, env=NCCL)
    got, ref = r["fp32"]
    assert got == pytest.approx(ref, rel=TOL, abs=TOL)
    got, ref = r["bf16"]
    assert got == pytest.approx(ref, rel=3e-2, abs=3e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(600)
def test_pipeline_2_stages_over_nccl_matches_unpipelined_training():
    check_pp2(run_function(_pp2_worker, nprocs=2, timeout=580, env=NCCL), TOL)
