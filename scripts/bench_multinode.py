#!/usr/bin/env python3
"""Multi-node launcher benchmark on a network-namespace SSH cluster built for the run.

Prints, in one run:
- start+finish time of a no-op job on 1, 2 and 3 hosts (2 processes each), through
  `dslaunch --hostfile` with the built-in SSH transport (with and without the preflight)
  and, side by side, through `--launcher pdsh` (which uses the system ssh client);
  ratio 3 hosts / 1 host (target: at most 1.5);
- time from a remote worker's failure to the last worker gone on every host, for
  workers that exit on SIGTERM and for workers that ignore it (those need the SIGKILL
  after --kill_grace); target: under the grace period + 1 s.

Needs root, sshd and iproute2 (scripts/setup_system.sh). Usage:
    .venv/bin/python scripts/bench_multinode.py [--repeats 3] [--grace 2]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import testbed  # noqa: E402  (the test suite's cluster builder, importable by path)
from bench_timing import median, repeat  # noqa: E402  (scripts/: the timing helpers every benchmark shares)

DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher"]

NOOP = "pass\n"
FAIL = """\
import os, signal, sys, time
if os.environ.get("IGNORE_TERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("pid", os.getpid(), flush=True)
if os.environ["RANK"] == os.environ["FAIL_RANK"]:
    time.sleep(1.0)
    with open(os.environ["FAIL_STAMP"], "w") as f:
        f.write(repr(time.time()))
    sys.exit(3)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def time_job(args, env, cwd, repeats: int) -> float:
    def job():
        res = subprocess.run(DSLAUNCH + args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise SystemExit(f"bench job failed ({res.returncode}): {res.stderr.strip()[-500:]}")

    return median(repeat(job, repeats))


def time_failure(hostfile, env, cwd, grace: float, ignore_term: bool, fail_rank: int) -> float:
    stamp = Path(cwd) / "fail.stamp"
    stamp.unlink(missing_ok=True)
    env = dict(env, IGNORE_TERM="1" if ignore_term else "0", FAIL_RANK=str(fail_rank), FAIL_STAMP=str(stamp))
    head = subprocess.Popen(DSLAUNCH + ["--hostfile", hostfile, "--kill_grace", str(grace), "--no_local_rank",
                                        "--skip_check", "--export", "IGNORE_TERM", "--export", "FAIL_RANK",
                                        "--export", "FAIL_STAMP", str(Path(cwd) / "fail.py")],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    pids = []
    for line in head.stdout:
        if " pid " in line:
            pids.append(int(line.split()[-1]))
    head.wait()
    # the head exits only after every agent reported its workers gone; confirm from /proc anyway
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.005)
    gone = time.time()
    return gone - float(stamp.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--grace", type=float, default=2.0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dslaunch-bench-"))
    (work / "noop.py").write_text(NOOP)
    (work / "fail.py").write_text(FAIL)
    tb = testbed.build_free("db", 120, 20, 3, work / "testbed")
    try:
        env = tb.ssh_env(work / "home")
        env["PDSH_SSH_ARGS_APPEND"] = f"-o UserKnownHostsFile={tb.known_hosts} -o LogLevel=ERROR"
        key = str(tb.key)
        print(f"cluster: {len(tb.hosts)} namespace hosts, 2 processes each; median of {args.repeats} runs")
        print(f"{'hosts':>5}  {'ssh':>8}  {'ssh+check':>9}  {'pdsh':>8}")
        results = {}
        for n in (1, 2, 3):
            hf = work / f"hosts{n}"
            hf.write_text("".join(f"{h.ip} slots=2\n" for h in tb.hosts[:n]))
            base = ["--hostfile", str(hf), "--no_local_rank"]
            ssh = time_job(base + ["--skip_check", "noop.py"], env, work, args.repeats)
            checked = time_job(base + ["noop.py"], env, work, args.repeats)
            pdsh = time_job(base + ["--skip_check", "--launcher", "pdsh", "--ssh_key", key, "noop.py"],
                            env, work, args.repeats)
            results[n] = (ssh, checked, pdsh)
            print(f"{n:>5}  {ssh:>7.2f}s  {checked:>8.2f}s  {pdsh:>7.2f}s")
        r = [results[3][i] / results[1][i] for i in range(3)]
        print(f"ratio 3 hosts / 1 host: ssh {r[0]:.2f}x, ssh+check {r[1]:.2f}x, pdsh {r[2]:.2f}x (target <= 1.5x)")
        print(f"ratio ssh / pdsh at 3 hosts: {results[3][0] / results[3][2]:.2f}x")
        hf = work / "hosts3"
        for ignore in (False, True):
            t = median(time_failure(str(hf), env, work, args.grace, ignore, fail_rank=5)
                                  for _ in range(args.repeats))
            what = "workers ignore SIGTERM (SIGKILL after grace)" if ignore else "workers exit on SIGTERM"
            print(f"remote failure -> last worker gone on every host, {what}: {t:.2f}s "
                  f"(grace {args.grace:g}s; target < {args.grace + 1:g}s; ratio to target {t / (args.grace + 1):.2f})")
    finally:
        tb.teardown()


if __name__ == "__main__":
    main()
