"""The 2-stage pipeline job of test_pipe_parity.py over NCCL, one CUDA device per stage
(gpu-marked: skips without 2 devices; the lead runs it on a GPU box):

    DSLAUNCH_TEST_BACKEND=nccl is set by the test itself;  .venv/bin/python -m pytest tests/test_pipe_gpu.py

Activations, gradients, shape headers and the abort notice then travel as CUDA tensors
through NCCL send/recv, the loss broadcast and the global gradient norm run on device
tensors. The reference is the same plain-torch training on the CPU, so the tolerance is
looser than the gloo run's 1e-5 (CUDA and CPU kernels round differently)."""
import pytest
import torch

from dist_harness import run_function
from test_pipe_parity import _pp2_worker, check_pp2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.mark.timeout(600)
def test_pipeline_2_stages_over_nccl_matches_unpipelined_training():
    results = run_function(_pp2_worker, nprocs=2, timeout=580, env={"DSLAUNCH_TEST_BACKEND": "nccl"})
    check_pp2(results, 1e-4)
