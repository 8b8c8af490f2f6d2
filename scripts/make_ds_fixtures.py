"""Make the DeepSpeed interop fixtures in tests/data/ds_interop/ with real DeepSpeed.

    .venv/bin/python scripts/make_ds_fixtures.py --ds-python /work/ds-venv/bin/python [--cases a,b]

DeepSpeed (0.19.8, CPU, gloo) and dslaunch run the same training script (`worker` below:
the same calls, `import deepspeed` or `import dslaunch.runtime as deepspeed`): a small MLP
with a buffer, WarmupLR, gradient clipping, on 2 ranks, fixed global batches (8 rows split
over the ranks, so the losses do not depend on the world size), saving at step 3 (one case
at step 6) and running 3 steps more. A case (CASES) is a ZeRO stage, a dtype and an
optimizer section (OPTIMIZERS: torch's AdamW via torch_adam, DeepSpeed's default FusedAdam,
its CPU Adam/Lion/Adagrad under offload, torch's Adagrad). For each it writes:

  ds/CASE/            DeepSpeed's checkpoint (latest + global_stepN/)
  dslaunch/CASE/      dslaunch's checkpoint of the same run
  fp32/CASE-ds.pt     DeepSpeed's zero_to_fp32 of ds/CASE (ZeRO cases with torch's AdamW)
  fp32/CASE-dslaunch.pt   DeepSpeed's zero_to_fp32 of dslaunch/CASE: it reads our format
  expected.json       per case: DeepSpeed's losses, dslaunch's losses, and the losses of
                      DeepSpeed resuming dslaunch/CASE for the 3 steps after the save
                      (DeepSpeed's load_checkpoint accepts our checkpoint); and under
                      "unsupported_by_deepspeed_on_cpu" the error DeepSpeed stops with for
                      each UNSUPPORTED case (fp16 and the CUDA-only FusedLion/FusedLamb)

tests/runtime/train/checkpoint/test_checkpoint_deepspeed.py uses them without DeepSpeed: dslaunch resumes ds/CASE at
1 and 2 ranks into other stages with DeepSpeed's losses, rewrites dslaunch/CASE identically,
and consolidates both like DeepSpeed's zero_to_fp32. DeepSpeed's own recovery scripts are
not copied into the fixtures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_interop")


class Case(NamedTuple):
    """One checkpoint: ZeRO stage, dtype, the optimizer config (OPTIMIZERS), the step saved at."""

    stage: int
    dtype: str
    optimizer: str = "torch_adamw"
    save_at: int = 3

    @property
    def steps(self) -> int:  # 3 steps after the save, compared with DeepSpeed's uninterrupted run
        return self.save_at + 3

    @property
    def tag(self) -> str:
        return f"global_step{self.save_at}"


# The optimizer section of the config, and whether ZeRO offloads the step to the CPU (DeepSpeed
# then picks its CPU optimizers). What DeepSpeed 0.19.8 steps with, on the CPU accelerator:
#   torch_adamw      torch.optim.AdamW ("torch_adam": true)
#   adam             FusedAdam, its default for Adam/AdamW (the CPU build of its fused kernel)
#   adam_offload     DeepSpeedCPUAdam
#   lion_offload     DeepSpeedCPULion
#   adagrad          torch.optim.Adagrad
#   adagrad_offload  DeepSpeedCPUAdagrad (its sum is called exp_avg_sq)
OPTIMIZERS = {
    "torch_adamw": ({"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}}, False),
    "adam": ({"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01}}, False),
    "adam_offload": ({"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.01}}, True),
    "lion_offload": ({"type": "Lion", "params": {"lr": 0.002, "weight_decay": 0.01}}, True),
    "adagrad": ({"type": "Adagrad", "params": {"lr": 0.05, "weight_decay": 0.01}}, False),
    "adagrad_offload": ({"type": "Adagrad", "params": {"lr": 0.05, "weight_decay": 0.01}}, True),
    "lion": ({"type": "Lion", "params": {"lr": 0.002, "weight_decay": 0.01}}, False),
    "lamb": ({"type": "Lamb", "params": {"lr": 0.02, "weight_decay": 0.01}}, False),
}
CASES = {
    # torch's AdamW, stages 0-3
    "s0_fp32": Case(0, "fp32"), "s0_bf16": Case(0, "bf16"), "s1_fp32": Case(1, "fp32"), "s2_fp32": Case(2, "fp32"),
    "s2_bf16": Case(2, "bf16"), "s3_fp32": Case(3, "fp32"), "s3_bf16": Case(3, "bf16"),
    # DeepSpeed's default Adam (FusedAdam): every stage, each dtype DeepSpeed runs on the CPU (the
    # tests also resume each into another stage)
    "adam_s0_fp32": Case(0, "fp32", "adam"), "adam_s1_bf16": Case(1, "bf16", "adam"),
    "adam_s2_fp32_step6": Case(2, "fp32", "adam", save_at=6),  # issue 23's case: ZeRO-2, 2 ranks, saved at step 6
    "adam_s3_bf16": Case(3, "bf16", "adam"),
    # DeepSpeed's CPU optimizers (offload_optimizer cpu) and torch's Adagrad
    "cpuadam_s2_fp32": Case(2, "fp32", "adam_offload"), "cpulion_s2_fp32": Case(2, "fp32", "lion_offload"),
    "adagrad_s0_fp32": Case(0, "fp32", "adagrad"), "cpuadagrad_s2_fp32": Case(2, "fp32", "adagrad_offload"),
}
# What DeepSpeed 0.19.8 cannot run on the CPU accelerator: `--cases` of these records the error.
UNSUPPORTED = {
    "adam_s2_fp16": Case(2, "fp16", "adam"),
    "lion_s2_fp32": Case(2, "fp32", "lion"),
    "lamb_s2_fp32": Case(2, "fp32", "lamb"),
}
STEPS, SAVE_AT, WORLD, ROWS = 6, 3, 2, 8
TAG = f"global_step{SAVE_AT}"
# Pipelines (DeepSpeed runs ZeRO 0-1 under a pipeline): 2 stages x 1 data-parallel rank,
# 4 micro-batches of 2 rows per step; layer files and one mp_rank_XX file per stage.
PIPE_CASES = {"pipe_s1_fp32": Case(1, "fp32")}
PIPE_STAGES, PIPE_MICRO, PIPE_ACCUM = 2, 2, 4


# -- the training script both engines run ----------------------------------------------------------
def make_model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(5, 9)
            self.out = torch.nn.Linear(9, 3)
            self.register_buffer("shift", torch.linspace(-0.5, 0.5, 3))

        def forward(self, x):
            return self.out(torch.tanh(self.inp(x))) + self.shift.to(x.dtype)

    torch.manual_seed(0)
    return Net()


def config(stage: int, dtype: str, world: int, optimizer: str = "torch_adamw") -> dict:
    opt, offload = OPTIMIZERS[optimizer]
    cfg = {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": ROWS // world,
           "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "steps_per_print": 1000,
           "optimizer": json.loads(json.dumps(opt)),
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 0.02}},
           "zero_optimization": {"stage": stage}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if dtype in ("bf16", "fp16"):
        cfg[dtype] = {"enabled": True}
    return cfg


def case_config(case: Case, world: int) -> dict:
    return config(case.stage, case.dtype, world, case.optimizer)


def torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)


def make_pipe(deepspeed, stages: int):
    """The same 4 layers as a PipelineModule of `stages` stages (one layer without weights)."""
    import importlib

    import torch

    pipe = importlib.import_module(deepspeed.__name__ + ".pipe")
    torch.manual_seed(0)
    layers = [pipe.LayerSpec(torch.nn.Linear, 5, 9), pipe.LayerSpec(torch.nn.Tanh),
              pipe.LayerSpec(torch.nn.Linear, 9, 9), pipe.LayerSpec(torch.nn.Linear, 9, 3)]
    return pipe.PipelineModule(layers=layers, num_stages=stages, loss_fn=torch.nn.MSELoss(),
                               partition_method="uniform")


def pipe_config(stage: int, dtype: str) -> dict:
    cfg = config(stage, dtype, 1)
    cfg.update(train_batch_size=PIPE_MICRO * PIPE_ACCUM, train_micro_batch_size_per_gpu=PIPE_MICRO,
               gradient_accumulation_steps=PIPE_ACCUM)
    return cfg


def pipe_batches(step: int, dtype) -> list:
    """One step's micro-batches, (x, y) each; the same whatever the pipeline depth."""
    import torch

    g = torch.Generator().manual_seed(200 + step)
    return [(torch.randn(PIPE_MICRO, 5, generator=g).to(dtype), torch.randn(PIPE_MICRO, 3, generator=g).to(dtype))
            for _ in range(PIPE_ACCUM)]


def batch(step: int, rank: int, world: int, dtype):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, 5, generator=g)
    y = torch.randn(ROWS, 3, generator=g)
    n = ROWS // world
    return x[rank * n:(rank + 1) * n].to(dtype), y[rank * n:(rank + 1) * n]


def worker(rank: int, job: dict) -> None:
    import torch.distributed as dist

    from bench_ranks import finish_script_rank, script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, job)
    stage, dtype, save_at = job["stage"], job["dtype"], job.get("save_at", SAVE_AT)
    if job.get("pipe"):
        model = make_pipe(deepspeed, job["world"])
        cfg = pipe_config(stage, dtype)
    else:
        model = make_model()
        cfg = config(stage, dtype, job["world"], job.get("optimizer", "torch_adamw"))
    if job.get("universal"):  # make_ds_universal_fixtures.py: resume a universal checkpoint folder
        cfg["checkpoint"] = {"load_universal": True}
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=cfg)[0]
    start = 0
    if job.get("load"):
        path, client = engine.load_checkpoint(job["load"])
        assert path is not None, job["load"]
        start = engine.global_steps
    losses = []
    tdtype = torch_dtype(dtype)
    for step in range(start, save_at + 3):
        if job.get("pipe"):  # train_batch's loss is the same on every stage
            losses.append(float(engine.train_batch(iter(pipe_batches(step, tdtype)))))
        else:
            x, y = batch(step, rank, job["world"], tdtype)
            loss = (engine(x).float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(float(total) / job["world"])
        if job.get("save") and step + 1 == save_at:
            engine.save_checkpoint(job["save"], tag=f"global_step{save_at}", client_state={"epoch": 1, "source": job["engine"]})
    finish_script_rank(rank, job, losses)


def run(python: str, job: dict, capture: bool = False) -> list:
    """The losses of one run of `worker` on job["world"] processes; with capture, a failure
    returns the last line rank 0 wrote to stderr instead of stopping the script."""
    from bench_ranks import run_script_ranks  # on sys.path when run as a script (tests import this file without it)
    return run_script_ranks(python, __file__, job, job["world"], ROOT, capture=capture)


def zero_to_fp32(ds_python: str, ckpt: str, out: str) -> None:
    code = ("import sys, torch\nfrom deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
            "sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])\n"
            "torch.save({k: v.contiguous() for k, v in sd.items()}, sys.argv[2])\n")
    subprocess.run([ds_python, "-c", code, ckpt, out], check=True, stdout=subprocess.DEVNULL)


def _tidy(save_dir: str) -> None:
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's and our recovery scripts
        path = os.path.join(save_dir, name)
        if os.path.exists(path):
            os.remove(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds-python", default="/work/ds-venv/bin/python", help="a python with deepspeed==0.19.8")
    ap.add_argument("--cases", default=",".join(list(CASES) + list(PIPE_CASES) + list(UNSUPPORTED)))
    args = ap.parse_args()
    expected = {}
    for name in args.cases.split(","):
        if name in UNSUPPORTED:  # record why DeepSpeed cannot make this one here
            case = UNSUPPORTED[name]
            got = run(args.ds_python, dict(case._asdict(), engine="deepspeed", world=WORLD), capture=True)
            if isinstance(got, list):
                raise SystemExit(f"{name}: DeepSpeed ran it ({got}); move it to CASES")
            expected.setdefault("unsupported_by_deepspeed_on_cpu", {})[name] = {**case._asdict(), "error": got}
            print(f"{name}: DeepSpeed fails: {got}", flush=True)
            continue
        case = PIPE_CASES[name] if name in PIPE_CASES else CASES[name]
        base = dict(case._asdict(), world=PIPE_STAGES if name in PIPE_CASES else WORLD, pipe=name in PIPE_CASES)
        ds_dir, our_dir = os.path.join(OUT, "ds", name), os.path.join(OUT, "dslaunch", name)
        for d in (ds_dir, our_dir):
            shutil.rmtree(d, ignore_errors=True)
        ds_losses = run(args.ds_python, dict(base, engine="deepspeed", save=ds_dir))
        our_losses = run(sys.executable, dict(base, engine="dslaunch", save=our_dir))
        ds_resumed = run(args.ds_python, dict(base, engine="deepspeed", load=our_dir))
        expected[name] = {"deepspeed": ds_losses, "dslaunch": our_losses, "deepspeed_resumed_dslaunch": ds_resumed}
        # DeepSpeed's zero_to_fp32 refuses pipeline checkpoints; the optimizer does not change what it reads
        if case.stage > 0 and name not in PIPE_CASES and case.optimizer == "torch_adamw":
            os.makedirs(os.path.join(OUT, "fp32"), exist_ok=True)
            zero_to_fp32(args.ds_python, ds_dir, os.path.join(OUT, "fp32", f"{name}-ds.pt"))
            zero_to_fp32(args.ds_python, our_dir, os.path.join(OUT, "fp32", f"{name}-dslaunch.pt"))
        _tidy(ds_dir)
        _tidy(our_dir)
        print(f"{name}: deepspeed {ds_losses}\n{' ' * len(name)}  dslaunch  {our_losses}\n"
              f"{' ' * len(name)}  deepspeed resuming dslaunch {ds_resumed}", flush=True)
    path = os.path.join(OUT, "expected.json")
    old = {}
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
    for key, value in expected.items():
        if key == "unsupported_by_deepspeed_on_cpu":
            old.setdefault(key, {}).update(value)
        else:
            old[key] = value
    with open(path, "w") as fh:
        json.dump(old, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    from bench_ranks import script_main  # scripts/, on sys.path when run as a script

    script_main(worker, main)
