"""A tiny CPU script with an activation checkpointing switch (tests/launcher/test_autotune_cli.py).

    autotune_ckpt_job.py --deepspeed_config CFG --batch N --ckpt true|false

--ckpt is what a Hugging Face script's --gradient_checkpointing is: the tuner sets it per
trial through arg_mappings.activation_checkpointing. With it on, each of the 4 blocks
runs under deepspeed.checkpointing.checkpoint (only its input is kept; backward recomputes it).
"""
import argparse

import torch

import dslaunch.runtime as deepspeed

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--batch", type=int, required=True)
p.add_argument("--ckpt", choices=("true", "false"), required=True)
args = p.parse_args()


class Net(torch.nn.Module):
    def __init__(self, ckpt: bool):
        super().__init__()
        self.ckpt = ckpt
        self.stem = torch.nn.Linear(64, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                                              torch.nn.Linear(128, 64)) for _ in range(4))

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = deepspeed.checkpointing.checkpoint(block, h) if self.ckpt else block(h)
        return h


torch.manual_seed(0)
model = Net(args.ckpt == "true")
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
assert engine.train_micro_batch_size_per_gpu() == args.batch
for _ in range(8):
    loss = engine(torch.randn(args.batch, 16, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()
