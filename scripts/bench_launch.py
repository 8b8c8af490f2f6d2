"""Launch overhead: dslaunch vs torchrun, side by side in one run.

For each worker (a no-op script, and gloo init_process_group + one all_reduce) it times,
interleaved and repeated:
    bare      python WORKER with WORLD_SIZE=1 (no launcher at all)
    dslaunch  dslaunch --num_gpus 2 --master_port 0 WORKER
    torchrun  torchrun --standalone --nproc-per-node 2 WORKER
and prints medians, each launcher's overhead (its time minus the bare run) and the ratio
dslaunch/torchrun of the overheads. Target: ratio <= 0.5.

    python scripts/bench_launch.py [--repeat 5]
    python scripts/bench_launch.py --bind [--repeat 5] [--nprocs 2]

--bind measures --bind_cores_to_rank instead: the ZeRO-2 CPU-offload loop of
scripts/examples/zero_offload_steps.py under dslaunch, interleaved in three ways:
    share     dslaunch's default: no pinning, OMP_NUM_THREADS = cores / ranks
    all       OMP_NUM_THREADS = all cores per rank, no pinning (DeepSpeed's launcher leaves
              torch to use every core in every rank)
    bound     --bind_cores_to_rank: each rank pinned to its share, OMP_NUM_THREADS to match
and prints each one's median step time and the speed-up of `bound` over the other two.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from bench_timing import free_port, median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "scripts" / "examples"
BIN = Path(sys.executable).parent


def timed(argv, env) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"bench_launch: {' '.join(map(str, argv))} failed ({r.returncode}):\n{r.stderr.decode()[-2000:]}")
    return elapsed


def step_time(argv, env) -> float:
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if "step_s " in ln), None)
    if r.returncode != 0 or line is None:
        sys.exit(f"bench_launch: {' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return float(line.split("step_s ")[1])


def bench_bind(args) -> int:
    cores = len(os.sched_getaffinity(0))
    worker = str(EXAMPLES / "zero_offload_steps.py")
    base = [sys.executable, "-m", "dslaunch.launcher", "--num_gpus", str(args.nprocs), "--master_port", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSLAUNCH_") and k != "OMP_NUM_THREADS"}
    ways = {
        "share": (base, env),
        "all": (base, dict(env, OMP_NUM_THREADS=str(cores))),
        "bound": (base + ["--bind_cores_to_rank"], env),
    }
    runs = {k: [] for k in ways}
    for _ in range(args.repeat):
        for name, (argv, e) in ways.items():
            runs[name].append(step_time(argv + [worker, "--steps", str(args.steps)], e))
    med = {k: median(v) for k, v in runs.items()}
    print(f"# {cores} usable CPUs, {args.nprocs} ranks, ZeRO-2 CPU offload, {args.steps} steps, "
          f"{args.repeat} runs each, median step time; load average {os.getloadavg()[0]:.1f}")
    for name in ways:
        print(f"{name:<6} {med[name]:.4f} s   runs: {' '.join(f'{t:.3f}' for t in runs[name])}")
    print(f"bound vs share: {med['share'] / med['bound']:.2f}x   bound vs all: {med['all'] / med['bound']:.2f}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bind", action="store_true", help="measure --bind_cores_to_rank (see above)")
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    if args.bind:
        return bench_bind(args)
    dslaunch = BIN / "dslaunch"
    torchrun = BIN / "torchrun" if (BIN / "torchrun").exists() else shutil.which("torchrun")
    if not dslaunch.exists() or not torchrun:
        sys.exit("bench_launch: needs dslaunch and torchrun in the interpreter's bin directory (bash scripts/setup_env.sh)")
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("DSLAUNCH_")}
    base_env.setdefault("OMP_NUM_THREADS", "1")
    print(f"# {os.cpu_count()} CPUs, python {sys.version.split()[0]}, {args.repeat} runs each, medians; 2 processes per launch")
    print(f"{'worker':<10} {'bare s':>8} {'dslaunch s':>11} {'torchrun s':>11} {'ds overhead':>12} {'tr overhead':>12} {'ratio':>6}")
    for name in ("noop", "allreduce"):
        worker = str(EXAMPLES / f"{name}.py")
        runs = {"bare": [], "dslaunch": [], "torchrun": []}
        for _ in range(args.repeat):
            bare_env = dict(base_env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(free_port()))
            runs["bare"].append(timed([sys.executable, worker], bare_env))
            runs["dslaunch"].append(timed([str(dslaunch), "--num_gpus", "2", "--master_port", "0", worker], base_env))
            runs["torchrun"].append(timed([str(torchrun), "--standalone", "--nproc-per-node", "2", worker], base_env))
        med = {k: median(v) for k, v in runs.items()}
        ds, tr = med["dslaunch"] - med["bare"], med["torchrun"] - med["bare"]
        print(f"{name:<10} {med['bare']:8.3f} {med['dslaunch']:11.3f} {med['torchrun']:11.3f} "
              f"{ds:12.3f} {tr:12.3f} {ds / tr:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
