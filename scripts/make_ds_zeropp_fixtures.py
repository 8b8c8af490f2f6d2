"""Make the ZeRO++ fixture tests/data/ds_zeropp/expected.json with real DeepSpeed.

    .venv/bin/python scripts/make_ds_zeropp_fixtures.py --ds-python /work/ds-venv/bin/python [--only NAME]
    .venv/bin/python scripts/make_ds_zeropp_fixtures.py --compare

DeepSpeed 0.19.8 (CPU accelerator, gloo, 4 processes on this host) runs every case of
tests/zeropp_workload.py: ZeRO-3, qwZ, qgZ, hpZ, all three (also with accumulation 2 and
with CPU offload of the optimizer), and frozen weights kept quantized. Its ranks are laid out as
2 hosts of 2 (LOCAL_SIZE=2: DeepSpeed's CPU accelerator reports that many devices per node,
which is what its qgZ and hpZ read). Each case's per-step losses, or the error DeepSpeed
stops with, are recorded; tests/runtime/zero/test_zeropp.py runs the same cases under dslaunch and
compares. Each case runs in fresh processes (DeepSpeed creates hpZ's group once per process).

DeepSpeed's quantizer kernels exist only for CUDA; scripts/ds_cpu_quantizer.py (a CPU
re-implementation of them, with their interface) is installed in their place, the one
change made to DeepSpeed. `--compare` runs the cases here and prints each one's distance
from the recording.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
OUT = os.path.join(TESTS, "data", "ds_zeropp")


def worker(rank: int, world: int, port: int, job: dict, out: str) -> None:
    from bench_ranks import rank_env, write_result  # scripts/, on sys.path when run as a script

    rank_env(rank, world, port, LOCAL_SIZE=str(job["per_host"]))
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, TESTS)
    sys.path.insert(0, HERE)
    import zeropp_workload

    if job["engine"] == "deepspeed":
        import deepspeed
        import deepspeed.runtime.comm.coalesced_collectives as coalesced
        import deepspeed.runtime.zero.partition_parameters as partition

        import ds_cpu_quantizer

        partition.CUDAQuantizer.quantizer_cuda_module = ds_cpu_quantizer  # see the module docstring
        coalesced.quantizer_module = ds_cpu_quantizer
        deepspeed.init_distributed("gloo")
        ds = deepspeed
    else:
        import torch.distributed as dist

        import dslaunch.runtime as ds

        dist.init_process_group("gloo", rank=rank, world_size=world)
    result = zeropp_workload.run_case(ds, zeropp_workload.CASES[job["name"]], rank)
    write_result(out, rank, result)


def run_here(engine: str, name: str) -> dict:
    sys.path.insert(0, HERE)
    sys.path.insert(0, TESTS)
    import zeropp_workload
    from bench_ranks import spawn

    return spawn(worker, zeropp_workload.WORLD, {"engine": engine, "name": name,
                                                 "per_host": zeropp_workload.PER_HOST})[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed")
    p.add_argument("--only", default="", help="only this case (the others are kept as recorded)")
    p.add_argument("--compare", action="store_true", help="run the cases here and print the distance per case")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:  # inside DeepSpeed's Python
        job = json.loads(args.job)
        print("RESULT " + json.dumps(run_here("deepspeed", job["name"])), flush=True)
        return
    sys.path.insert(0, TESTS)
    import zeropp_workload

    path = os.path.join(OUT, "expected.json")
    names = [n for n in zeropp_workload.CASES if not args.only or n == args.only]
    if args.compare:
        expected = json.load(open(path))["cases"]
        for name in names:
            ours, theirs = run_here("dslaunch", name), expected.get(name, {})
            if "losses" in ours and "losses" in theirs:
                rel = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"]))
                print(f"{name:16s} largest relative loss difference {rel:.2e}")
            else:
                print(f"{name:16s} dslaunch: {ours.get('error', 'trains')} | "
                      f"DeepSpeed: {theirs.get('error', 'trains')}")
        return
    if not args.ds_python:
        p.error("--ds-python is required (or --compare)")
    recorded = json.load(open(path))["cases"] if os.path.exists(path) else {}
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([TESTS, HERE]))
    for name in names:
        proc = subprocess.run([args.ds_python, __file__, "--job", json.dumps({"name": name})], env=env,
                              capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{name}: DeepSpeed's run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        recorded[name] = json.loads(lines[-1][len("RESULT "):])
        print(f"{name}: {recorded[name]}", flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"deepspeed": "0.19.8", "world": zeropp_workload.WORLD, "per_host": zeropp_workload.PER_HOST,
                   "cases": recorded}, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
