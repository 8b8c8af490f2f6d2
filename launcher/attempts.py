"""The restart policy and the stop signals, shared by single-node and multi-node jobs.

A job is a series of attempts. Each attempt runs the whole worker group (every node);
when one worker fails, the attempt ends for all of them and, until --max_restarts is used
up, the next attempt starts everyone again with DSLAUNCH_RESTART_COUNT one higher
(torchrun's policy). SIGINT/SIGTERM/SIGHUP to the launcher end the job without a restart;
the same signal again means "kill now" instead of waiting out --kill_grace.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

from dslaunch.launcher.failure import Failure
from dslaunch.launcher.output import AttemptSummary, JobOutput
from dslaunch.launcher.reaper import signal_name

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class AttemptResult:
    exit_code: int
    failure: Optional[Failure] = None
    stop_signal: Optional[int] = None  # the signal that ended the attempt, when nothing failed
    ended: Dict[str, str] = field(default_factory=dict)  # label -> how each other worker ended
    total: int = 0  # workers in the attempt
    lost: Dict[str, str] = field(default_factory=dict)  # host -> why it was lost (elastic jobs re-plan)
    resized: bool = False  # the workers stopped for a resize the head asked for (elastic jobs)


class StopSignals:
    """Installs the launcher's handlers for FORWARDED signals for the length of a `with`.

    on_signal(signum, again) runs in the handler: it must only set flags or write to a
    pipe (Supervisor.request_stop, a queue put), never block or print through a buffer.
    """

    def __init__(self, on_signal: Callable[[int, bool], None], err_fd: Optional[int], kill_grace: float):
        self.first: Optional[int] = None
        self._on_signal = on_signal
        self._err_fd = err_fd
        self._grace = kill_grace
        self._previous: Dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        for s in FORWARDED:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        again = self.first is not None
        if not again:
            self.first = signum
            # a raw write: the handler may run inside a buffered write to the same stream
            msg = (f"dslaunch: received {signal_name(signum)}: stopping the workers "
                   f"(again to kill them at once, else SIGKILL after {self._grace:g}s)\n")
            if self._err_fd is not None:
                try:
                    os.write(self._err_fd, msg.encode())
                except OSError:
                    pass
        self._on_signal(signum, again)


def run_attempts(attempt: Callable[[int], AttemptResult], max_restarts: int, output: JobOutput,
                 stopped: Callable[[], Optional[int]]) -> int:
    """Run attempt(0), attempt(1), ... under the restart policy; returns the job's exit code."""
    result = AttemptResult(0)
    for n in range(max_restarts + 1):
        if stopped() is not None:
            return 128 + stopped()
        result = attempt(n)
        if result.failure is None:
            if result.stop_signal is not None:
                output.say(f"stopped by {signal_name(result.stop_signal)}; all {result.total} worker(s) ended")
            return result.exit_code
        output.summary(AttemptSummary(result.failure, result.ended, result.total))
        if stopped() is not None:
            return result.exit_code
        if n < max_restarts:
            output.say(f"restarting every worker (restart {n + 1} of {max_restarts})")
    if max_restarts:
        output.say(f"giving up after {max_restarts} restart(s)")
    return result.exit_code
