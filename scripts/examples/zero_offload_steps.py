"""A ZeRO-2 + CPU-offload training loop for launcher benchmarks: prints its median step time.

    dslaunch --num_gpus 2 scripts/examples/zero_offload_steps.py [--steps 12] [--dim 512] [--layers 4]

Each rank trains the same MLP stack under dslaunch.runtime with the optimizer offloaded to
the CPU (the CPU Adam kernel does the step), so most of the time is CPU work whose speed
depends on how the ranks' threads share the cores: what --bind_cores_to_rank changes.
Rank 0 prints `step_s MEDIAN` after a warm-up step.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

import dslaunch.runtime as deepspeed

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int, default=0)
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--dim", type=int, default=512)
ap.add_argument("--layers", type=int, default=4)
args = ap.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(args.dim, 4 * args.dim), torch.nn.GELU(),
                                                  torch.nn.Linear(4 * args.dim, args.dim)) for _ in range(args.layers)])
cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
       "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
gen = torch.Generator().manual_seed(dist.get_rank())
times = []
for step in range(args.steps + 1):
    x = torch.randn(16, args.dim, generator=gen)
    t0 = time.perf_counter()
    loss = torch.nn.functional.mse_loss(engine(x.to(torch.bfloat16)).float(), torch.tanh(x))
    engine.backward(loss)
    engine.step()
    if step:  # the first step builds buffers and kernels
        times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(f"step_s {statistics.median(times):.4f}", flush=True)
engine.destroy()
