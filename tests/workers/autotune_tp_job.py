"""A tiny CPU training script that AutoTP can split (tests/launcher/test_autotune_cli.py).

    autotune_tp_job.py --deepspeed_config CFG --batch N

Eight residual blocks of up (32 -> 128) and down (128 -> 32) projections; the config's
`tensor_parallel.partition_config` says how AutoTP splits them (up by columns, down by
rows), so the tuner's profile trial finds degree 2 allowed on 2 ranks. --batch is the
micro-batch size, set by the tuner through arg_mappings. Every rank draws the same
inputs (one seed): ranks of one tensor group must see the same micro-batch.
"""
import argparse

import torch
from torch import nn

import dslaunch.runtime as deepspeed

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--batch", type=int, required=True)
p.add_argument("--steps", type=int, default=20)
args = p.parse_args()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


torch.manual_seed(0)
model = nn.Sequential(*[Block() for _ in range(8)])
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
assert engine.train_micro_batch_size_per_gpu() == args.batch
for step in range(args.steps):
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(args.batch, 8, 32)).pow(2).mean()
        engine.backward(loss)
        engine.step()
