"""Make the PyTorch-style backward fixture tests/data/ds_pystyle/expected.json with real DeepSpeed.

    .venv/bin/python scripts/make_ds_pystyle_fixtures.py --ds-python /work/ds-venv/bin/python [--only PATTERN]
    .venv/bin/python scripts/make_ds_pystyle_fixtures.py --compare [--only PATTERN]

DeepSpeed (0.19.8, CPU accelerator, gloo) runs every case of tests/pystyle_workload.py:
engine.backward(loss), loss.backward(), engine.scale(loss).backward() and out.backward(grad)
at ZeRO 0-3, 1 and 2 ranks (processes on this host, a free loopback port), accumulation 1 and 2,
fp32/bf16/fp16, CPU offload, no_sync and two engines with one loss. Each case's per-step
losses, or the error DeepSpeed stops with, are recorded. tests/runtime/train/test_pytorch_style_backward.py
runs the same cases under dslaunch and compares; `--compare` runs them here and prints each
case's difference from the recording. DeepSpeed is run, never imported by the project.

fp16: DeepSpeed's CPU accelerator refuses fp16 unless the processor's oneDNN has fp16
kernels ("Type fp16 is not supported on your device"); the workers here tell DeepSpeed it
has them (CPU_Accelerator.is_fp16_supported), and torch computes fp16 on any CPU. Nothing
else of DeepSpeed is changed.
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
TESTS = os.path.join(ROOT, "tests")
OUT = os.path.join(TESTS, "data", "ds_pystyle")


def worker(rank: int, world: int, port: int, job: dict, out: str) -> None:
    """Run job["names"] under job["engine"] ("deepspeed" or "dslaunch") on this rank."""
    from bench_ranks import rank_env, write_result  # on sys.path when run as a script

    rank_env(rank, world, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, TESTS)
    import pystyle_workload

    if job["engine"] == "deepspeed":
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True  # see the module docstring
        deepspeed.init_distributed("gloo")
        ds = deepspeed
    else:
        import dslaunch.runtime as ds

        dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in job["names"]:
        results[name] = pystyle_workload.run_case(ds, pystyle_workload.CASES[name], rank, world)
        if rank == 0 and job["engine"] == "deepspeed":
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    write_result(out, rank, results)


def run_here(world: int, job: dict) -> dict:
    from bench_ranks import spawn  # on sys.path when run as a script
    return spawn(worker, world, job)[0]  # rank 0's results


def compare(expected: dict, names_of) -> None:
    """Run the cases here with dslaunch and print, per case, the largest difference of its
    losses from DeepSpeed's (or both answers where either stopped), then the largest per dtype
    over the cases where DeepSpeed's answer is not known to be wrong (DEEPSPEED_DIFFERS)."""
    from pystyle_workload import DEEPSPEED_DIFFERS

    worst = {}
    for world in (1, 2):
        names = names_of(world)
        if not names:
            continue
        ours = run_here(world, {"engine": "dslaunch", "names": names})
        for name in names:
            a, b = ours[name], expected["cases"].get(name)
            if b is None:
                print(f"{name}: no DeepSpeed result recorded")
            elif "losses" in a and "losses" in b:
                d = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
                if name in DEEPSPEED_DIFFERS:
                    print(f"{name:36s} max |loss difference| {d:.2e} (DeepSpeed differs: "
                          f"{DEEPSPEED_DIFFERS[name][1]})")
                    continue
                dtype = name.split("_")[2]
                worst[dtype] = max(worst.get(dtype, 0.0), d)
                print(f"{name:36s} max |loss difference| {d:.2e}")
            else:
                print(f"{name:36s} dslaunch: {a.get('error', 'trains')[:70]}\n{'':36s} DeepSpeed: "
                      f"{b.get('error', 'trains')[:70]}")
    for dtype, d in sorted(worst.items()):
        print(f"{dtype}: largest difference where both train: {d:.2e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed")
    p.add_argument("--only", default="", help="only the cases whose name contains this (kept with the rest)")
    p.add_argument("--compare", action="store_true",
                   help="run the cases here with dslaunch and print how far each is from the recorded losses")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:  # inside DeepSpeed's Python: run one world size's cases, print their results
        job = json.loads(args.job)
        print("RESULTS " + json.dumps(run_here(job["world"], {"engine": "deepspeed", "names": job["names"]})),
              flush=True)
        return
    sys.path.insert(0, TESTS)
    import pystyle_workload

    def names_of(world):
        return [n for n, c in pystyle_workload.CASES.items() if c["world"] == world and args.only in n]

    path = os.path.join(OUT, "expected.json")
    if args.compare:
        with open(path) as fh:
            compare(json.load(fh), names_of)
        return
    if not args.ds_python:
        sys.exit("error: give --ds-python, a Python with deepspeed installed")
    expected = {"cases": {}}
    if os.path.exists(path):
        with open(path) as fh:
            expected = json.load(fh)
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               # a private extension cache: a build killed in the shared one leaves a lock behind
               TORCH_EXTENSIONS_DIR=os.path.join(tempfile.gettempdir(), "ds-pystyle-fixture-ext"))
    for world in (1, 2):
        names = names_of(world)
        if not names:
            continue
        job = json.dumps({"world": world, "names": names})
        proc = subprocess.run([args.ds_python, os.path.abspath(__file__), "--job", job], env=env,
                              capture_output=True, text=True, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
        if proc.returncode or not lines:
            sys.exit(f"error: DeepSpeed's run of the {world}-rank cases failed:\n{proc.stderr[-4000:]}")
        for name, result in json.loads(lines[-1][len("RESULTS "):]).items():
            expected["cases"][name] = result
            print(f"{name}: {result}", flush=True)
    version = subprocess.run([args.ds_python, "-c", "import deepspeed, torch; print(deepspeed.__version__, "
                              "torch.__version__.split('+')[0])"], env=env, capture_output=True, text=True)
    expected["deepspeed"], expected["torch"] = version.stdout.split()[-2:]
    os.makedirs(OUT, exist_ok=True)
    expected["cases"] = dict(sorted(expected["cases"].items()))
    with open(path, "w") as fh:
        json.dump(expected, fh, indent=1)


if __name__ == "__main__":
    main()
