"""Run a plan whose nodes are all this machine: attempts, restarts, signals, reports.

One Supervisor per attempt; after a failure the whole group restarts (torchrun-style)
until --max_restarts is used up. SIGINT/SIGTERM/SIGHUP are forwarded to the workers and
end the job without a restart. Everything the launcher itself says goes to stderr with
a `dslaunch:` prefix, so a job's stdout is only its workers' lines.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import BinaryIO, List, Optional

from dslaunch.launcher import reaper
from dslaunch.launcher.output import ConsoleSink, LogDirSink, tee
from dslaunch.launcher.plan import LaunchPlan
from dslaunch.launcher.supervisor import GroupResult, Supervisor, WorkerSpec, WorkerState

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def say(err: BinaryIO, text: str) -> None:
    try:
        err.write(("".join(f"dslaunch: {line}\n" for line in text.splitlines())).encode())
        err.flush()
    except (BrokenPipeError, ValueError):
        pass


def worker_specs(plan: LaunchPlan, restart_count: int, environ: dict) -> List[WorkerSpec]:
    specs = []
    for node in plan.nodes:
        for lr, argv in enumerate(node.argvs):
            env = dict(environ)
            env.update(plan.worker_env(node, lr, restart_count))
            specs.append(WorkerSpec(node.node.first_rank + lr, argv, env))
    return specs


def report_failure(err: BinaryIO, result: GroupResult, total: int) -> None:
    f = result.failure
    lines = [f.describe()]
    if f.stderr_tail:
        lines.append(f"last {len(f.stderr_tail)} line(s) of {f.label}'s stderr:")
        lines += [f"  | {t}" for t in f.stderr_tail]
    stopped = sum(1 for s in result.states.values() if s is WorkerState.STOPPED)
    if stopped:
        lines.append(f"stopped the other {stopped} of {total} worker(s)")
    say(err, "\n".join(lines))


def run_local(plan: LaunchPlan, *, out: Optional[BinaryIO] = None, err: Optional[BinaryIO] = None,
              environ: Optional[dict] = None) -> int:
    """Run every attempt; returns the launcher's exit code."""
    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    environ = dict(os.environ if environ is None else environ)
    opts = plan.options
    console = ConsoleSink(out, err)
    current: List[Optional[Supervisor]] = [None]
    stop: List[Optional[int]] = [None]

    def on_signal(signum, _frame):
        if stop[0] is None:
            # A raw write: the handler may run inside a buffered write to the same stream,
            # where another buffered write would raise "reentrant call".
            msg = (f"dslaunch: received {reaper.signal_name(signum)}: stopping the workers "
                   f"(again to kill them at once, else SIGKILL after {opts.kill_grace:g}s)\n")
            try:
                os.write(err.fileno(), msg.encode())
            except (OSError, ValueError, AttributeError):
                pass
        again = stop[0] is not None
        stop[0] = stop[0] or signum
        if current[0] is not None:
            current[0].request_stop(signum, force=again)

    previous = {s: signal.signal(s, on_signal) for s in _FORWARDED}
    try:
        for attempt in range(opts.max_restarts + 1):
            if stop[0] is not None:
                break
            specs = worker_specs(plan, attempt, environ)
            logs = (LogDirSink(opts.log_dir, [s.rank for s in specs], f"dslaunch run {plan.run_id} restart {attempt}")
                    if opts.log_dir else None)
            sup = Supervisor(specs, tee(console, logs), kill_grace=opts.kill_grace)
            current[0] = sup
            if stop[0] is not None:
                sup.request_stop(stop[0])
            try:
                result = sup.run()
            finally:
                current[0] = None
                if logs is not None:
                    logs.close()
            if result.state is WorkerState.SUCCEEDED:
                return 0
            if result.failure is None:
                say(err, f"stopped by {reaper.signal_name(result.stop_signal)}; all {len(specs)} worker(s) ended")
                return result.exit_code
            report_failure(err, result, len(specs))
            if stop[0] is not None:
                return result.exit_code
            if attempt < opts.max_restarts:
                say(err, f"restarting the worker group (restart {attempt + 1} of {opts.max_restarts})")
                continue
            if opts.max_restarts:
                say(err, f"giving up after {opts.max_restarts} restart(s)")
            return result.exit_code
        return 128 + (stop[0] or signal.SIGTERM)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
