"""The communication layer on a CUDA device (gpu-marked: skips without one).

- One NCCL rank (init_distributed's default backend with CUDA) trains a few steps under
  the engine with the comms logger on and exits without destroy_process_group(): exit 0,
  and none of NCCL's "process group has NOT been destroyed" warning (the exit handler did
  it); the loss read at the boundary and the non-finite check run on device tensors.
- Two gloo ranks on the one GPU: collectives on CUDA tensors go through runtime.comm with
  the comms logger timing them (it synchronises the device before reading the clock).
"""
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_function

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SCRIPT = r'''
import torch
import dslaunch.runtime as deepspeed

cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1,
       "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "comms_logger": {"enabled": True}, "zero_optimization": {"stage": 1}}
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
assert engine.device.type == "cuda" and torch.distributed.get_backend() == "nccl"
for step in range(6):
    x = torch.randn(4, 32, device=engine.device, dtype=torch.bfloat16)
    if step == 3:
        x[0, 0] = float("nan")
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
print("STEPS", engine.global_steps, engine.skipped_steps, flush=True)
'''


@pytest.mark.timeout(300)
def test_one_nccl_rank_exits_cleanly_without_destroy(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "STEPS 3 1" in p.stdout  # the NaN micro-batch's step (step 2) was skipped
    assert "non-finite gradient norm" in p.stdout
    assert "has NOT been destroyed" not in p.stderr, p.stderr[-3000:]


def _gloo_on_cuda():
    import dslaunch.runtime as deepspeed

    comm = deepspeed.comm
    torch.cuda.set_device(0)
    world = comm.get_world_group()
    comm.configure(enabled=True, prof_all=True)
    t = torch.full((1 << 16,), float(comm.get_rank() + 1), device="cuda")
    comm.all_reduce(t, group=world, label="cuda all_reduce")
    b = torch.full((1 << 16,), float(comm.get_rank()), device="cuda")
    comm.broadcast(b, src=1, group=world)
    summary = comm.log_summary(return_dict=True)["summary"]
    return t[0].item(), b[0].item(), summary["all_reduce"][1 << 18]["count"], \
        summary["all_reduce"][1 << 18]["avg_latency_ms"]


@pytest.mark.timeout(200)
def test_gloo_collectives_on_cuda_tensors_are_timed():
    for value, bcast, count, ms in run_function(_gloo_on_cuda, nprocs=2, timeout=180):
        assert value == 3.0 and bcast == 1.0 and count == 1 and ms > 0
