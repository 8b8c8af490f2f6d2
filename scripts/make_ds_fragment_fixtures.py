"""Make tests/data/ds_fragments/fragments.pt: what real DeepSpeed's tensor-fragment calls
return for a tiny run (deepspeed.utils.safe_get_full_fp32_param and friends).

    .venv/bin/python scripts/make_ds_fragment_fixtures.py --ds-python /work/ds-venv/bin/python

DeepSpeed 0.19.8 (CPU, gloo, 2 ranks) runs `exercise` below for each case of CASES (a ZeRO
stage, a dtype, CPU offload or not): the MLP of make_ds_fixtures.py, AdamW, two steps, then
a third backward; in the gradient window it reads every parameter's fp32 master,
exp_avg, exp_avg_sq and gradient (and, at stage 3, each rank's local chunks), then writes
a new master, a new exp_avg and a new gradient for three parameters, steps, and reads the
masters again. tests/runtime/zero/test_fragments.py runs the same `exercise` under dslaunch's
compatibility package and compares, without DeepSpeed.

Stage 0 in fp32 is left out: DeepSpeed has no fp32 master there and returns None; in bf16
it returns None for everything but the gradient (dslaunch answers both; docs/zero.md says
so). The test skips what DeepSpeed returned None for.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "data", "ds_fragments", "fragments.pt")
WORLD, ROWS = 2, 8
# Said explicitly: DeepSpeed's default is 1.0, dslaunch's 0 (off). The third step's gradient is
# clipped here: what is read in the window is the gradient before clipping.
CLIP = 1.0
# name -> (stage, dtype, CPU offload)
CASES = {
    "s0_bf16": (0, "bf16", False),
    "s1_fp32": (1, "fp32", False), "s1_bf16": (1, "bf16", False), "s1_fp32_offload": (1, "fp32", True),
    "s2_fp32": (2, "fp32", False), "s2_bf16": (2, "bf16", False), "s2_fp32_offload": (2, "fp32", True),
    "s3_fp32": (3, "fp32", False), "s3_bf16": (3, "bf16", False), "s3_fp32_offload": (3, "fp32", True),
}


def make_model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # sizes 40, 8, 24, 3: 75 in all, so stages 1-2 pad and a parameter straddles the two
            # ranks; out.bias does not divide by 2 (stage 3 pads it). The written ones (EDITS) do:
            # DeepSpeed 0.19.8's stage-3 safe_set_full_* fail on a parameter that does not.
            self.inp = torch.nn.Linear(5, 8)
            self.out = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.out(torch.tanh(self.inp(x)))

    torch.manual_seed(0)
    return Net()


def config(stage: int, dtype: str, offload, nvme_path: str = "", gas: int = 1, persist: int = 0) -> dict:
    """offload: False, True (cpu) or "nvme" (optimizer state in files under nvme_path); gas:
    micro-batches per step (each one batch() of ROWS rows); persist: stage 3 keeps parameters of
    at most this many elements whole."""
    cfg = {"train_batch_size": ROWS * gas, "train_micro_batch_size_per_gpu": ROWS // WORLD,
           "gradient_accumulation_steps": gas,
           "steps_per_print": 1000, "gradient_clipping": CLIP,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "eps": 1e-8,
                                                     "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": persist}}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = \
            {"device": "nvme", "nvme_path": nvme_path} if offload == "nvme" else {"device": "cpu"}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # dynamic loss scaling from 2**8: gradients read in the window carry it
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


LOSS_SCALE = {"fp16": 2.0 ** 8}  # no overflow in these steps: the scale stays at its start


def batch(step: int, rank: int, dtype):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(ROWS, 5, generator=g), torch.randn(ROWS, 3, generator=g)
    n = ROWS // WORLD
    return x[rank * n:(rank + 1) * n].to(dtype), y[rank * n:(rank + 1) * n]


# what the writes put in: (parameter, call, how the new value is made from what was read)
EDITS = [("inp.weight", "fp32", 0.5), ("out.weight", "exp_avg", 0.5), ("inp.bias", "grad", 2.0)]


def _cpu(t):
    return None if t is None else t.detach().float().cpu().clone()


def exercise(deepspeed, stage: int, dtype: str, offload, rank: int, gas: int = 1, persist: int = 0) -> dict:
    """The run both engines do; returns what rank `rank` read (tensors on the CPU). With gas
    > 1, step s runs micro-batches s*gas .. s*gas+gas-1, and the reads follow the last one."""
    with tempfile.TemporaryDirectory() as nvme_path:
        return _exercise(deepspeed, stage, dtype, offload, rank, nvme_path, gas, persist)


def _exercise(deepspeed, stage, dtype, offload, rank, nvme_path, gas, persist) -> dict:
    import torch
    from deepspeed import utils as du

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    model = make_model()
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                  config=config(stage, dtype, offload, nvme_path, gas, persist))[0]
    named = dict(engine.module.named_parameters())

    def loss_of(step):
        x, y = batch(step, rank, tdtype)
        return (engine(x).float() - y).pow(2).mean()

    for micro in range(3 * gas - 1):
        engine.backward(loss_of(micro))
        engine.step()  # a step at the boundary only
    engine.backward(loss_of(3 * gas - 1))
    out = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}, "grad": {}, "local": {}}
    for name, p in named.items():
        got = {"fp32": du.safe_get_full_fp32_param(p), "exp_avg": du.safe_get_full_optimizer_state(p, "exp_avg"),
               "exp_avg_sq": du.safe_get_full_optimizer_state(p, "exp_avg_sq"), "grad": du.safe_get_full_grad(p)}
        for k, v in got.items():
            out[k][name] = _cpu(v)
        if stage == 3:
            out["local"][name] = {"fp32": _cpu(du.safe_get_local_fp32_param(p)),
                                  "exp_avg": _cpu(du.safe_get_local_optimizer_state(p, "exp_avg")),
                                  "grad": _cpu(du.safe_get_local_grad(p))}
    for name, what, factor in EDITS:
        if out[what][name] is None:  # nothing to write (DeepSpeed at stage 0 returns None): skipped
            continue
        value = out[what][name] * factor
        if what == "fp32":
            du.safe_set_full_fp32_param(named[name], value)
        elif what == "grad":
            du.safe_set_full_grad(named[name], value)
        else:
            du.safe_set_full_optimizer_state(named[name], value, what)
    engine.step()
    out["after"] = {name: _cpu(du.safe_get_full_fp32_param(p)) for name, p in named.items()}
    return out


def worker(rank: int, job: dict) -> None:
    import torch
    import torch.distributed as dist

    from bench_ranks import script_rank  # scripts/, on sys.path in a worker

    deepspeed = script_rank(rank, dict(job, world=WORLD), deepspeed_only=True)
    results = {}
    for name in job["cases"]:
        results[name] = exercise(deepspeed, *CASES[name], rank)
        if rank == 0:
            nones = sorted({k for k, v in results[name].items() if isinstance(v, dict) and None in v.values()})
            print(f"{name}: done{'; None for ' + ', '.join(nones) if nones else ''}", file=sys.stderr, flush=True)
    torch.save(results, f"{job['result']}.{rank}")
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ds-python", required=True, help="a python with DeepSpeed 0.19.8 installed")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("job", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, json.loads(args.job))
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        from bench_ranks import free_port  # on sys.path when run as a script (tests import this file without it)
        job = {"port": free_port(), "result": os.path.join(tmp, "out"), "cases": list(CASES)}
        procs = [subprocess.Popen([args.ds_python, __file__, "--ds-python", args.ds_python, "--worker", str(r),
                                   json.dumps(job)], cwd=tmp) for r in range(WORLD)]
        codes = [p.wait(timeout=1200) for p in procs]
        if any(codes):
            raise SystemExit(f"DeepSpeed workers failed: exit codes {codes}")
        ranks = [torch.load(f"{job['result']}.{r}", weights_only=True) for r in range(WORLD)]
    fixture = {"deepspeed": "0.19.8", "world": WORLD, "cases": {}}
    for name in CASES:
        case = ranks[0][name]
        case["local"] = [r[name]["local"] for r in ranks]  # stage 3: every rank's chunks
        fixture["cases"][name] = case
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(fixture, OUT)
    print(f"wrote {os.path.relpath(OUT, ROOT)}: {len(CASES)} cases")


if __name__ == "__main__":
    sys.exit(main())
