"""Soak test for clean exits (issue #9 item 7): many short 2-rank jobs under dslaunch, each
of which must exit 0.

    python scripts/soak_exit.py                 # 200 jobs cycling through the cases below
    python scripts/soak_exit.py --jobs 40 --bare # the bare-torch baseline: a gloo script that
                                                 # never calls destroy_process_group
    python scripts/soak_exit.py --jobs 40 --bare --with-runtime   # the same script, importing
                                                 # dslaunch.runtime (its exit handler)
    python scripts/soak_exit.py --jobs 44 --without-shutdown  # the runtime jobs with the exit
                                                 # handler unregistered: the "before" figure

Each job is `dslaunch --num_gpus 2 scripts/soak_exit.py --worker CASE`: a tiny model trained
for 3 steps through `dslaunch.runtime.initialize` under ZeRO stage 0-3, with optimizer and
parameter offload (cpu, nvme), bf16, and a checkpoint saved by one job and resumed by the
next. Every other job also calls torch.distributed.destroy_process_group() itself, so both
endings are covered. The last line printed is the tally; exit status 1 if any job failed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))

CASES = {
    "stage0": {"stage": 0},
    "stage0-bf16": {"stage": 0, "bf16": True},
    "stage1": {"stage": 1},
    "stage1-offload-cpu": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    "stage2": {"stage": 2},
    "stage2-offload-nvme": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "{tmp}"}},
    "stage3": {"stage": 3},
    "stage3-offload-param-cpu": {"stage": 3, "offload_param": {"device": "cpu"},
                                 "offload_optimizer": {"device": "cpu"}},
    "stage3-offload-param-nvme": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "{tmp}"}},
    "stage2-save": {"stage": 2, "save": True},
    "stage2-resume": {"stage": 2, "resume": True},  # always right after stage2-save
}


def _config(case: dict, tmp: str) -> dict:
    zero = {"stage": case["stage"], "stage3_param_persistence_threshold": 0}
    for key in ("offload_optimizer", "offload_param"):
        if key in case:
            zero[key] = {k: (v.format(tmp=tmp) if isinstance(v, str) else v) for k, v in case[key].items()}
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero}
    if case.get("bf16"):
        cfg["bf16"] = {"enabled": True}
    return cfg


def worker(name: str, tmp: str, destroy: bool, without_shutdown: bool) -> int:
    import torch

    import dslaunch.runtime as deepspeed

    if without_shutdown:  # measure what the runtime's exit handler prevents
        import atexit

        atexit.unregister(deepspeed.comm.shutdown._at_exit)

    case = CASES[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=_config(case, tmp))
    ckpt = os.path.join(tmp, "ckpt")
    if case.get("resume"):
        engine.load_checkpoint(ckpt)
    for step in range(3):
        g = torch.Generator().manual_seed(step * 10 + engine.global_rank)
        x = torch.randn(4, 16, generator=g).to(engine.device, engine.compute_dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    if case.get("save"):
        engine.save_checkpoint(ckpt)
    if destroy:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(f"soak ok {name} rank {engine.global_rank}", flush=True)
    return 0


BARE = """
import torch, torch.distributed as dist
{runtime}
dist.init_process_group("gloo")
for _ in range(5):
    t = torch.ones(1000)
    dist.all_reduce(t)
print("bare ok", dist.get_rank(), flush=True)
"""


def _dslaunch() -> str:
    exe = os.path.join(os.path.dirname(sys.executable), "dslaunch")
    return exe if os.path.exists(exe) else "dslaunch"


def _run_job(argv, timeout: float):
    start = time.monotonic()
    try:
        # --master_port 0: a free port, so that jobs of others on a shared machine (on the
        # default 29500) cannot join this one's rendezvous
        p = subprocess.run([_dslaunch(), "--num_gpus", "2", "--master_port", "0", *argv], capture_output=True,
                           text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
    return rc, out, time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--bare", action="store_true", help="run the bare torch gloo script instead")
    ap.add_argument("--with-runtime", action="store_true", help="--bare: the script imports dslaunch.runtime")
    ap.add_argument("--without-shutdown", action="store_true",
                    help="unregister the runtime's exit handler in the workers (the before figure)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per job")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tmp", help=argparse.SUPPRESS)
    ap.add_argument("--destroy", action="store_true", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()  # dslaunch may append --local_rank
    if args.worker:
        return worker(args.worker, args.tmp, args.destroy, args.without_shutdown)

    tally, failures = Counter(), []
    names = list(CASES)
    with tempfile.TemporaryDirectory(prefix="soak-exit-") as tmp:
        script = os.path.join(tmp, "bare.py")
        with open(script, "w") as fh:
            fh.write(BARE.format(runtime="import dslaunch.runtime" if args.with_runtime else ""))
        started = time.monotonic()
        for i in range(args.jobs):
            if args.bare:
                label, argv = "bare" + ("+runtime" if args.with_runtime else ""), [script]
            else:
                label = names[i % len(names)]
                job_tmp = os.path.join(tmp, "job")
                if label != "stage2-resume":  # the resume reads what stage2-save wrote
                    shutil.rmtree(job_tmp, ignore_errors=True)
                    os.makedirs(job_tmp)
                destroy = i % 2 == 1
                label += " +destroy" if destroy else ""
                argv = [HERE, "--worker", names[i % len(names)], "--tmp", job_tmp] + (["--destroy"] if destroy else [])
                argv += ["--without-shutdown"] if args.without_shutdown else []
            rc, out, secs = _run_job(argv, args.timeout)
            tally[(label, rc)] += 1
            if rc != 0:
                tail = [ln for ln in out.splitlines() if ln.strip()][-6:]
                failures.append((i, label, rc, tail))
                print(f"job {i} ({label}): exit {rc} after {secs:.1f}s", flush=True)
                for ln in tail:
                    print(f"    {ln}", flush=True)
            elif (i + 1) % 20 == 0:
                print(f"{i + 1}/{args.jobs} jobs, {len(failures)} non-zero so far "
                      f"({time.monotonic() - started:.0f}s)", flush=True)
    print("per case (label, exit status): count")
    for (label, rc), n in sorted(tally.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"  {label:32s} {str(rc):>8s}: {n}")
    load = os.getloadavg()
    print(f"soak_exit: {args.jobs - len(failures)}/{args.jobs} jobs exited 0, {len(failures)} non-zero "
          f"({time.monotonic() - started:.0f}s, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
