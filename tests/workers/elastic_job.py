"""Test worker for elastic jobs: a plain DeepSpeed-style script that becomes elastic with
no change (dslaunch --checkpoint_dir makes the runtime save, resume and re-cut).

    elastic_job.py CASE STEPS [PACE_FILE]
CASES
    zero2 | zero3   a tiny MLP, global batch 12 of micro batches of 1, fp32; the script loops
                    over the engine's data loader (an epoch is 64 steps) until step STEPS
    pipe | pipe1    the same layers as a 2-stage (pipe1: 1-stage) PipelineModule, global batch
                    8; the script calls train_batch() until engine.global_steps is STEPS

Rank 0 prints `step N loss L world W` for every optimizer step, L the mean loss over the
global batch (the same at every world size, up to the order of the sums). With PACE_FILE,
rank 0 starts step N only once the file holds a number >= N (the test paces the job). With
$CRASH_AT=N, the last rank of the job's first attempt exits 1 as step N begins.
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

import dslaunch.runtime as deepspeed

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
case, total = args[0], int(args[1])
pace = args[2] if len(args) > 2 else None
rank = int(os.environ.get("RANK", "0"))


def wait_for(step: int) -> None:
    if os.environ.get("CRASH_AT") == str(step) and os.environ.get("DSLAUNCH_RESTART_COUNT") == "0" \
            and rank == int(os.environ.get("WORLD_SIZE", "1")) - 1:
        print(f"rank {rank} crashes at step {step}", file=sys.stderr, flush=True)
        os._exit(1)
    if pace is None or rank != 0:
        return
    while True:
        try:
            with open(pace) as f:
                if int(f.read().strip() or 0) >= step:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.02)


batch = 8 if case.startswith("pipe") else 12
g = torch.Generator().manual_seed(1)
x = torch.randn(64 * batch, 8, generator=g)  # one epoch of 64 steps, whatever STEPS is (at most 64)
y = (x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(64 * batch, 1, generator=g))
data = torch.utils.data.TensorDataset(x, y)
config = {"train_batch_size": batch, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1_000_000,
          "optimizer": {"type": "Adam", "params": {"lr": 0.02}},
          "zero_optimization": {"stage": 3 if case == "zero3" else 1 if case.startswith("pipe") else 2}}
torch.manual_seed(0)
layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]

if case.startswith("pipe"):
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=2 if case == "pipe" else 1,
                                        loss_fn=lambda out, target: F.mse_loss(out, target))
    engine, _, _, _ = deepspeed.initialize(model=net, config=config, training_data=data)
    while engine.global_steps < total:
        wait_for(engine.global_steps + 1)
        loss = engine.train_batch()
        if rank == 0:
            print(f"step {engine.global_steps} loss {float(loss):.10f} world {engine.world_size}", flush=True)
else:
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = torch.nn.Sequential(*layers)

        def forward(self, inputs, target):
            return F.mse_loss(self.seq(inputs), target)

    engine, _, loader, _ = deepspeed.initialize(model=Net(), config=config, training_data=data)
    acc, mean = 0.0, None
    for inputs, target in loader:
        if engine.micro_steps % engine.gradient_accumulation_steps() == 0:
            wait_for(engine.global_steps + 1)
        loss = engine(inputs, target)
        engine.backward(loss)
        acc += float(loss.detach())
        if engine.is_gradient_accumulation_boundary():
            mean = torch.tensor([acc / engine.gradient_accumulation_steps()])
            deepspeed.comm.all_reduce(mean, group=engine.dp_group, label="test: step loss")
            acc = 0.0
        engine.step()
        if mean is not None:  # printed once the step is done
            if rank == 0:
                print(f"step {engine.global_steps} loss {float(mean) / engine.dp_world_size:.10f} "
                      f"world {engine.world_size}", flush=True)
            mean = None
        if engine.global_steps >= total:
            break
