"""A tiny CPU training script for `dslaunch --autotuning` (tests/launcher/test_autotune_cli.py).

    autotune_job.py --deepspeed_config CFG --batch N [--steps S] [--out FILE]
                    [--crash STAGE:MBS] [--hang STAGE:MBS]

--batch is the micro-batch size, set by the tuner through arg_mappings (as a Hugging Face
script's --per_device_train_batch_size would be). --crash / --hang make rank 1 raise /
sleep before the first step of one configuration, to prove tuning records the failure and
goes on. Every rank prints `cleanup ran` from a `finally` block, and its step loop catches
Exception: a trial must stop the script by unwinding it, not by exit(), and a loop that
catches Exception must not swallow the stop. Rank 0 writes --out (what it trained with) at the end.
"""
import argparse
import json
import time

import torch

import dslaunch.runtime as deepspeed

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=-1)
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--batch", type=int, required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--out")
p.add_argument("--crash")
p.add_argument("--hang")
args = p.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
mbs, gas, stage = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(), \
    engine.zero_optimization_stage()
assert mbs == args.batch, f"--batch {args.batch} but the config's micro-batch is {mbs}"
here = f"{stage}:{mbs}"
try:
    if engine.global_rank == 1 and here == args.crash:
        raise RuntimeError(f"injected crash at stage {stage} micro-batch {mbs}")
    if engine.global_rank == 1 and here == args.hang:
        time.sleep(3600)
    for step in range(args.steps):
        try:
            for _ in range(gas):
                x = torch.randn(mbs, 16, 64)
                loss = engine(x).pow(2).mean()
                engine.backward(loss)
                engine.step()
        except Exception as exc:  # a loop that logs and goes on (as trainers do) must not swallow the stop
            print(f"swallowed {type(exc).__name__}", flush=True)
    if engine.global_rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"stage": stage, "micro_batch": mbs, "gas": gas, "steps": engine.global_steps}, f)
finally:
    print(f"cleanup ran on rank {engine.global_rank}", flush=True)
