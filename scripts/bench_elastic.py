#!/usr/bin/env python3
"""Elastic training on a network-namespace SSH cluster built for the run (3 hosts x 2 slots).

One job of tests/workers/elastic_job.py (a tiny MLP under ZeRO-2, fp32, global batch 12)
runs under `dslaunch --min_nodes 1 --checkpoint_dir ... --checkpoint_every N` while the
cluster changes under it, one event at a time, each at a chosen step (the job is paced by a
file, so events land where the script puts them whatever the machine's load):

    partition  host 3's link goes down (the head hears nothing for --heartbeat_timeout)
    return     host 3's link comes back (it joins at the next checkpoint)
    crash      host 2's processes and sshd are killed (its connections close at once)
    return     host 2's sshd starts again
    drain      `dslaunch drain` host 3 (the job saves at the next step boundary)
    undrain    `dslaunch undrain` host 3

For each event it prints the time from the event to the launcher's re-plan (its `resuming
on ...` line: detection, the stop of the old workers, the choice of hosts), the time to the
first step at the new size (goal for a loss: within the heartbeat timeout + 15 s; the
difference is the start of the new workers: ssh, Python and torch imports, the rendezvous,
loading the checkpoint) and the steps lost, i.e. redone after
the resume (goal: 0 on a drain, at most the checkpoint interval on a crash), and at the
end the largest difference between the job's losses and the same script's in one process.
With --plot it draws loss against step with the host count under it; with --json it writes
the figures.

Needs root, sshd and iproute2 (scripts/setup_system.sh), and matplotlib for --plot (the
`bench` extra). Usage:
    .venv/bin/python scripts/bench_elastic.py [--heartbeat 5] [--every 5] [--plot docs/elastic.png]
                                              [--json scripts/bench_elastic.json]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import testbed  # noqa: E402  (the test suite's cluster builder, importable by path)

DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher"]
WORKER = str(ROOT / "tests" / "workers" / "elastic_job.py")
STEP = re.compile(r"^\[(\S+):(\d+)\] step (\d+) loss (\S+) world (\d+)$")


class Job:
    """dslaunch running the paced script; every line with its arrival time."""

    def __init__(self, launch: List[str], env: dict, cwd: Path, steps: int):
        self.pace = cwd / "pace"
        self.set_pace(0)
        self.proc = subprocess.Popen(DSLAUNCH + launch + [WORKER, "zero2", str(steps), str(self.pace)],
                                     env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: "queue.Queue" = queue.Queue()
        self.steps: List[Tuple[int, float, int, float]] = []  # step, loss, world, when
        self.said: List[str] = []
        for stream in (self.proc.stdout, self.proc.stderr):
            threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put((time.monotonic(), line.rstrip("\n")))
        self.lines.put((time.monotonic(), None))

    def set_pace(self, n: int) -> None:
        tmp = self.pace.with_suffix(".tmp")
        tmp.write_text(str(n))
        tmp.replace(self.pace)

    def wait_for(self, pattern: str, timeout: float = 600) -> Tuple[float, str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                when, line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"no line matching {pattern!r} within {timeout:g} s") from None
            if line is None:
                raise SystemExit(f"dslaunch ended (exit {self.proc.wait()}) before {pattern!r}:\n"
                                 + "\n".join(self.said[-20:]))
            m = STEP.match(line)
            if m:
                self.steps.append((int(m.group(3)), float(m.group(4)), int(m.group(5)), when))
            elif line.startswith("dslaunch:") or "] dslaunch:" in line:
                self.said.append(line)
            if re.search(pattern, line):
                return when, line


def reference(steps: int, cwd: Path) -> Dict[int, float]:
    res = subprocess.run([sys.executable, WORKER, "zero2", str(steps)], capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    if res.returncode != 0:
        raise SystemExit(f"the one-process run failed: {res.stderr[-500:]}")
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+) world 1$", res.stdout, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heartbeat", type=float, default=5.0, help="--heartbeat_timeout of the job (s)")
    ap.add_argument("--every", type=int, default=5, help="--checkpoint_every of the job (steps)")
    ap.add_argument("--plot", help="write the loss/host-count figure here (PNG, needs matplotlib)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--replot", help="only draw --plot again from a --json file of an earlier run")
    args = ap.parse_args()
    if args.replot:
        d = json.loads(Path(args.replot).read_text())
        plot(d["points"], {int(k): v for k, v in d["reference"].items()}, d["events"], args.plot)
        return
    every, steps = args.every, 9 * args.every
    work = Path(tempfile.mkdtemp(prefix="bench-elastic-"))
    tb = testbed.build_free("dx", 160, 20, 3, work / "testbed")
    events: List[dict] = []
    try:
        env = tb.ssh_env(work / "home")
        env.update(GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
        (work / "hosts").write_text("".join(f"{h.name} slots=2\n" for h in tb.hosts))
        h = tb.hosts
        ref = reference(steps, work)
        launch = ["-H", str(work / "hosts"), "--min_nodes", "1", "--master_port", "0",
                  "--heartbeat_timeout", str(args.heartbeat), "--kill_grace", "3",
                  "--checkpoint_dir", str(work / "ck"), "--checkpoint_every", str(every)]
        job = Job(launch, env, work, steps)
        run_id = job.wait_for(r"dslaunch: elastic job \S+:")[1].split("elastic job ")[1].split(":")[0]

        def at_step(n: int) -> None:
            job.set_pace(n)
            job.wait_for(rf"\] step {n} loss ")

        def next_step_says(pattern: str) -> None:
            """Allow one more step and wait for the line it brings: the head said every host's
            workers have the request, so they act on it at that step."""
            job.set_pace(job.steps[-1][0] + 1)
            job.wait_for(pattern)

        def record(name: str, note: str, t0: float, at: int, world: int, pace: int) -> None:
            job.set_pace(pace)
            decided, resumed = job.wait_for(r"dslaunch: .*resuming on ")
            t1 = job.wait_for(rf"\] step \d+ loss \S+ world {world}$")[0]
            m = re.search(r"at step ([\d,]+).*from step ([\d,]+)", resumed)
            lost = int(m.group(1).replace(",", "")) - int(m.group(2).replace(",", "")) if m else None
            events.append({"event": name, "note": note, "seconds": round(t1 - t0, 1),
                           "decided_s": round(decided - t0, 1), "steps_lost": lost,
                           "message": resumed.split("dslaunch: ", 1)[1], "at_step": at})

        at_step(every + 3)
        subprocess.run(["ip", "link", "set", "dev", h[2].veth, "down"], check=True)
        record(f"partition {h[2].name}", "link down: lost after --heartbeat_timeout", time.monotonic(), every + 3, 4,
               3 * every - 1)
        at_step(3 * every - 1)
        subprocess.run(["ip", "link", "set", "dev", h[2].veth, "up"], check=True)
        t0 = time.monotonic()
        job.wait_for(rf"{h[2].name} answers again")
        next_step_says(r"a host joins: stopping after the checkpoint")
        record(f"{h[2].name} returns", "link up: joins at the next checkpoint", t0, 3 * every - 1, 6, 5 * every - 2)
        at_step(5 * every - 2)
        tb.crash_host(1)
        record(f"crash {h[1].name}", "processes and sshd killed", time.monotonic(), 5 * every - 2, 4, 6 * every - 1)
        at_step(6 * every - 1)
        tb.restart_host(1)
        t0 = time.monotonic()
        job.wait_for(rf"{h[1].name} answers again")
        next_step_says(r"a host joins: stopping after the checkpoint")
        record(f"{h[1].name} returns", "sshd back: joins at the next checkpoint", t0, 6 * every - 1, 6, 7 * every - 3)
        at_step(7 * every - 3)
        t0 = time.monotonic()
        subprocess.run(DSLAUNCH + ["drain", h[2].name, "--job", run_id], env=env, check=True, capture_output=True)
        job.wait_for(rf"dslaunch: draining {h[2].name} \(dslaunch drain\)")
        next_step_says(r"drain requested: saving at step")
        record(f"drain {h[2].name}", "dslaunch drain", t0, 7 * every - 3, 4, 7 * every + 1)
        at_step(7 * every + 1)
        subprocess.run(DSLAUNCH + ["undrain", h[2].name, "--job", run_id], env=env, check=True, capture_output=True)
        t0 = time.monotonic()
        job.wait_for(rf"{h[2].name} answers again")
        next_step_says(r"a host joins: stopping after the checkpoint")
        record(f"undrain {h[2].name}", "dslaunch undrain: joins at the next checkpoint", t0, 7 * every + 1, 6, steps)
        code = job.proc.wait(timeout=600)
        while True:
            try:
                job.wait_for(r"^$", timeout=5)
            except SystemExit:
                break
        if code != 0:
            raise SystemExit(f"the elastic job failed with exit {code}:\n" + "\n".join(job.said[-20:]))
    finally:
        subprocess.run(["ip", "link", "set", "dev", tb.hosts[2].veth, "up"], capture_output=True)
        tb.teardown()

    diff = max(abs(loss - ref[s]) for s, loss, _, _ in job.steps)
    print(f"elastic job: {steps} steps of global batch 12 (ZeRO-2, fp32) on 3 hosts x 2 slots, "
          f"--heartbeat_timeout {args.heartbeat:g}, --checkpoint_every {every}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'event':<22} {'to the re-plan':>15} {'to first step at new size':>26} {'steps lost':>11}  "
          "launcher's line")
    for e in events:
        lost = "-" if e["steps_lost"] is None else str(e["steps_lost"])
        print(f"{e['event']:<22} {e['decided_s']:>13.1f} s {e['seconds']:>24.1f} s {lost:>11}  {e['message']}")
    print(f"goal: a loss resumes within the heartbeat timeout + 15 s ({args.heartbeat + 15:g} s); "
          f"steps lost 0 on a drain, at most {every} on a crash")
    print(f"largest |loss - one-process loss| over every step printed: {diff:.2e} (test bound 1e-5)")
    if args.json:
        Path(args.json).write_text(json.dumps({"heartbeat_timeout": args.heartbeat, "checkpoint_every": every,
                                               "load_average": round(os.getloadavg()[0], 1),
                                               "steps": steps, "events": events, "max_loss_diff": diff,
                                               "points": [list(p[:3]) for p in job.steps],
                                               "reference": ref}, indent=1) + "\n")
    if args.plot:
        plot(job.steps, ref, events, args.plot)


def runs(points) -> List[Tuple[int, int, int]]:
    """(first step, last step, world) of each stretch the job ran at one size, in the order run:
    a new stretch starts where the world size changes or the steps go back (a resume)."""
    out: List[List[int]] = []
    for step, _, world, *_ in points:
        if out and out[-1][2] == world and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step, world])
    return [tuple(r) for r in out]


def plot(points, ref: Dict[int, float], events: List[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    top.plot(sorted(ref), [ref[s] for s in sorted(ref)], "-", color="0.6", lw=3, label="one process (reference)")
    top.plot([p[0] for p in points], [p[1] for p in points], "o", ms=3.5, color="C0",
             label="elastic job (every step it printed, redone ones too)")
    top.set_ylabel("loss (mean over the global batch)")
    top.legend(loc="upper right")
    for first, last, world in runs(points):
        bottom.hlines(world // 2, first - 0.45, last + 0.45, color="C1", lw=5)
    bottom.set_ylim(0.5, 4.2)
    bottom.set_yticks([1, 2, 3])
    bottom.set_ylabel("hosts")
    bottom.set_xlabel("optimizer step (a stretch that goes back was redone after a loss)")
    for e in events:
        for ax in (top, bottom):
            ax.axvline(e["at_step"] + 0.5, color="0.8", lw=1, zorder=0)
        bottom.annotate(e["event"], (e["at_step"] + 0.5, 3.35), fontsize=7, rotation=18, ha="left")
    fig.suptitle("dslaunch --min_nodes 1, 3 hosts x 2 slots: partition, return, crash, return, drain, undrain",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
