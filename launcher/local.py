"""Run a plan whose nodes are all this machine: one Supervisor per attempt.

The attempts and their restarts follow attempts.run_attempts; SIGINT/SIGTERM/SIGHUP are
forwarded to the current attempt's workers and end the job. Everything the launcher says
goes to stderr with a `dslaunch:` prefix, so a job's stdout is only its workers' lines.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional

from dslaunch.launcher.attempts import AttemptResult, StopSignals, run_attempts
from dslaunch.launcher.output import JobOutput
from dslaunch.launcher.plan import LaunchPlan, WorkerPlan
from dslaunch.launcher.supervisor import GroupResult, Supervisor, WorkerSpec


def worker_spec(w: WorkerPlan, restart: int, inherited: Mapping[str, str], label: str = "",
                cwd: Optional[str] = None) -> WorkerSpec:
    """What the supervisor spawns for one planned worker: the inherited environment under the plan's."""
    env = dict(inherited)
    env.update(w.env_for(restart))
    return WorkerSpec(w.rank, list(w.argv), env, label=label, cwd=cwd, cpus=w.cpus)


def attempt_result(result: GroupResult, labels: Dict[int, str]) -> AttemptResult:
    failed = result.failure.rank if result.failure is not None else None
    ended = {labels[r]: state.value for r, state in result.states.items() if r != failed}
    return AttemptResult(result.exit_code, result.failure, result.stop_signal, ended, len(result.states))


def run_local(plan: LaunchPlan, output: JobOutput, inherited: Mapping[str, str], err_fd: Optional[int]) -> int:
    """Every attempt of an all-local plan; returns the launcher's exit code."""
    opts = plan.options
    workers = [w for node in plan.nodes for w in node.workers]
    current: List[Optional[Supervisor]] = [None]

    def on_signal(signum: int, again: bool) -> None:
        output.stopping(signum)
        if current[0] is not None:
            current[0].request_stop(signum, force=again)

    def attempt(restart: int) -> AttemptResult:
        specs = [worker_spec(w, restart, inherited) for w in workers]
        output.start_attempt(restart, [s.rank for s in specs])
        sup = Supervisor(specs, output, kill_grace=opts.kill_grace)
        current[0] = sup
        if signals.first is not None:
            sup.request_stop(signals.first)
        try:
            result = sup.run()
        finally:
            current[0] = None
        return attempt_result(result, {s.rank: s.label for s in specs})

    with StopSignals(on_signal, err_fd, opts.kill_grace) as signals:
        return run_attempts(attempt, opts.max_restarts, output, lambda: signals.first)
