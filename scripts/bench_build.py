#!/usr/bin/env python
"""Cold and warm build times of the CPU optimizer ops: dslaunch now (torch.utils.cpp_extension,
torch ops), dslaunch at an earlier revision (by default the direct-compiler builder this
replaced), and DeepSpeed's JIT build of the same op, side by side.

    .venv/bin/python scripts/bench_build.py [--ops adam,lion,adagrad] [--repeat 3]
        [--before-rev ebf4631] [--ds-python /work/ds-venv/bin/python] [--ds-repeat 1]

Every figure is one fresh process, timed from after `import torch` to the op being
loaded and callable: cold with an empty cache (dslaunch: a fresh ops cache; DeepSpeed: a
fresh TORCH_EXTENSIONS_DIR with DS_BUILD_OPS=0, its JIT path, which needs ninja), warm with
the cache the cold run left. dslaunch's "before" is the kernels/ folder of --before-rev,
extracted with `git archive` and imported under another name, built into its own cache.
Cold runs are repeated (--repeat; DeepSpeed's --ds-repeat) and the best and the median
are shown, with the load average before each: the machine is shared, so compare figures
of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from bench_timing import median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

ROOT = Path(__file__).resolve().parent.parent

# One measurement, run in a fresh process: prints {"seconds": ..., "cached": ...}.
OURS = """
import json, sys, time, torch
sys.path.insert(0, {path!r}) if {path!r} else None
mod = __import__({package!r} + ".builder", fromlist=["x"])
loader = __import__({package!r} + ".loader", fromlist=["x"])
spec = getattr(mod, "cpu_{op}_spec")()
t0 = time.perf_counter()
lib, built = loader.load_library(spec, {cache!r})
seconds = time.perf_counter() - t0
print(json.dumps({{"seconds": seconds, "cached": built.cached, "isa": built.isa}}))
"""

DEEPSPEED = """
import json, time, torch
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder({name!r})
t0 = time.perf_counter()
builder.load(verbose=False)
print(json.dumps({{"seconds": time.perf_counter() - t0, "cached": None, "isa": type(builder).__module__}}))
"""

DIRECT_REV = "ebf4631"  # the last revision whose builder ran the compiler directly (ctypes, no torch op)
DS_BUILDERS = {"adam": "CPUAdamBuilder", "lion": "CPULionBuilder", "adagrad": "CPUAdagradBuilder"}


def run(python: str, code: str, env: dict) -> dict:
    proc = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"bench_build: a measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(python: str, make_code, env: dict, repeat: int, tmp: Path, tag: str):
    """(cold seconds list, warm seconds, loads before each cold run)."""
    colds, loads, last_cache = [], [], None
    for i in range(repeat):
        cache = tmp / f"{tag}-{i}"
        loads.append(os.getloadavg()[0])
        colds.append(run(python, make_code(str(cache)), env(cache))["seconds"])
        last_cache = cache
    warm = run(python, make_code(str(last_cache)), env(last_cache))["seconds"]
    return colds, warm, loads


def extract(rev: str, tmp: Path) -> Path:
    """kernels/ of `rev`, importable as the package kernels_before."""
    dest = tmp / "before"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "kernels"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    (dest / "kernels").rename(dest / "kernels_before")
    return dest


def row(label: str, colds, warm, loads) -> str:
    med = median(colds)
    return (f"{label:44s} cold best {min(colds):6.2f} s  median {med:6.2f} s  warm {warm:5.2f} s  "
            f"(n={len(colds)}, load {min(loads):.1f}-{max(loads):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="adam", help="comma-separated: adam, lion, adagrad")
    ap.add_argument("--repeat", type=int, default=3, help="cold runs of each dslaunch build")
    ap.add_argument("--before-rev", default=DIRECT_REV, help="the revision to compare with ('' to skip)")
    ap.add_argument("--ds-python", default="/work/ds-venv/bin/python", help="a python with deepspeed ('' to skip)")
    ap.add_argument("--ds-repeat", type=int, default=1)
    args = ap.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in DS_BUILDERS]
    if bad or args.repeat < 1 or args.ds_repeat < 1:
        ap.error(f"--ops takes {', '.join(DS_BUILDERS)}; --repeat/--ds-repeat >= 1")
    base = dict(os.environ)
    base.pop("DSLAUNCH_OPS_CACHE", None)
    print(f"bench_build: {os.cpu_count()} CPUs, python {sys.executable}")
    with tempfile.TemporaryDirectory(prefix="bench-build-") as t:
        tmp = Path(t)
        before = extract(args.before_rev, tmp) if args.before_rev else None
        for op in ops:
            contenders = [("dslaunch now (cpp_extension, torch op)", sys.executable, "dslaunch.kernels", "")]
            if before is not None:
                how = " (direct, ctypes)" if args.before_rev == DIRECT_REV else ""  # only that revision's builder
                contenders.append((f"dslaunch {args.before_rev}{how}", sys.executable, "kernels_before",
                                   str(before)))
            print(f"\n== CPU {op}")
            for label, python, package, path in contenders:
                def code(cache, package=package, path=path):
                    return OURS.format(path=path, package=package, op=op, cache=cache)

                colds, warm, loads = measure(python, code, lambda cache: base, args.repeat, tmp,
                                             f"{package}-{op}")
                print(row(label, colds, warm, loads), flush=True)
            if args.ds_python:
                def ds_env(cache):
                    return dict(base, TORCH_EXTENSIONS_DIR=str(cache), DS_BUILD_OPS="0")

                colds, warm, loads = measure(args.ds_python, lambda cache: DEEPSPEED.format(name=DS_BUILDERS[op]),
                                             ds_env, args.ds_repeat, tmp, f"ds-{op}")
                print(row(f"DeepSpeed {DS_BUILDERS[op]} (JIT, DS_BUILD_OPS=0)", colds, warm, loads), flush=True)


if __name__ == "__main__":
    main()
