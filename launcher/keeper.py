"""The keeper: the process a launch starts as, which outlives the process that runs the job.

Why: the job process (the local supervisor, or the multi-node head) ends all it started
when a worker fails or a stop is asked for: it is a child subreaper, so even a
worker's child that left with setsid is re-parented to it and found. A SIGKILL ends the
job process before it can act. PR_SET_PDEATHSIG then ends its direct children, and the
watchdog (watchdog.py) every process carrying the job's marker variable, but a worker's
grandchild that left the session and dropped its environment (`env -i`, a daemon) was
re-parented to init and lived on.

So the launch forks once, before anything runs. The child is the job process; the
parent, the keeper, keeps the pid the user started, is a child subreaper and does nothing
but wait:
- a SIGKILL of the keeper sends the job process SIGTERM (its parent-death signal), and the
  job stops its workers as on any SIGTERM, its own subreaper finding every descendant;
- a SIGKILL of the job process re-parents every orphan below it to the keeper, which ends
  them all (SIGTERM, then SIGKILL after the grace period) and exits 128+9.
The job process has a process group of its own, so a signal sent to a whole group (Ctrl-C
at a terminal, `timeout`, `kill -- -PGID`) reaches the keeper alone, which passes it on
once: the launcher's "again to kill them at once" still counts presses, not copies.
Ctrl-Z stops both, and the keeper exits as the job process did. (SIGSTOP cannot be
passed on: it stops the keeper alone.)

A node agent on another host has no keeper: the head names a host whose agent dies, and
the agent's workers end by their parent-death signal and the watchdog.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import List, NoReturn

from dslaunch.launcher import reaper

# what the launcher acts on (attempts.FORWARDED), plus what tools send it to talk to a job
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# Set by the program's entry point (main.main): only a process that is a launch
# from its start may turn into a keeper, never one that calls the launcher as a library (a
# test runner's CliRunner would otherwise fork and exit the runner).
_state = {"enabled": False}


def enable() -> None:
    _state["enabled"] = True


def fork_keeper(kill_grace: float, name: str = "dslaunch") -> bool:
    """Fork the job process and return in it (True). The calling process becomes the keeper
    and never returns. Where the keeper cannot work (not Linux, threads already running, a
    failed fork) nothing is forked and False is returned: the job runs in this process, with
    the watchdog and parent-death signals alone."""
    if not _state["enabled"] or not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    _state["enabled"] = False  # once: a second launch in the job process (autotuning's) runs in it
    if not reaper.become_subreaper():
        return False
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # or the child would write the buffered text a second time
        except (OSError, ValueError):
            pass
    keeper = os.getpid()
    try:
        job = os.fork()
    except OSError:
        reaper.stop_subreaping()
        return False
    if job == 0:
        _become_job(keeper)
        return True
    try:
        os.setpgid(job, job)  # as the child does: whichever runs first, no group signal reaches both
    except OSError:
        pass
    _keep(job, kill_grace, name)


def _become_job(keeper: int) -> None:
    os.setpgid(0, 0)
    reaper.set_death_signal(signal.SIGTERM)
    if os.getppid() != keeper:  # the keeper died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _keep(job: int, kill_grace: float, name: str) -> NoReturn:
    def forward(signum, _frame) -> None:
        try:
            os.kill(job, signum)
        except ProcessLookupError:
            pass

    def stop_too(_signum, _frame) -> None:  # Ctrl-Z: the job process stops with us
        try:
            os.kill(job, signal.SIGSTOP)
        except ProcessLookupError:
            pass
        os.kill(os.getpid(), signal.SIGSTOP)

    def continue_too(_signum, _frame) -> None:
        try:
            os.kill(job, signal.SIGCONT)
        except ProcessLookupError:
            pass

    for s in FORWARDED:
        signal.signal(s, forward)
    signal.signal(signal.SIGTSTP, stop_too)
    signal.signal(signal.SIGCONT, continue_too)
    status = None
    while status is None:
        try:
            pid, st = os.waitpid(-1, 0)  # the job process, or an orphan re-parented here
        except ChildProcessError:
            os._exit(1)  # nothing to wait for: cannot happen while the job process lives
        if pid == job:
            status = st
    for s in FORWARDED:
        signal.signal(s, signal.SIG_IGN)  # the keeper's own exit is not interruptible now
    code = os.waitstatus_to_exitcode(status)
    ended = end_orphans(kill_grace)
    if code < 0:
        what = f"; ended the {ended} process(es) it left" if ended else ""
        _say(f"{name}: the job process {job} was killed by {reaper.signal_name(-code)}{what}")
    sys.stdout.flush()
    os._exit(128 - code if code < 0 else code)


def end_orphans(kill_grace: float) -> int:
    """End every process below this one (orphans re-parented to it): SIGTERM, then SIGKILL
    after kill_grace seconds. Returns how many there were."""
    me = os.getpid()
    seen: set = set()

    def alive() -> List[int]:
        _reap()
        pids = [p for p in reaper.descendants(me) if reaper.alive(p)]
        seen.update(pids)
        return pids

    left = alive()
    if left:
        deadline = time.monotonic() + kill_grace
        while left and time.monotonic() < deadline:
            reaper.signal_processes(left, signal.SIGTERM)  # newly found ones too
            time.sleep(0.05)
            left = alive()
        deadline = time.monotonic() + 5.0
        while left and time.monotonic() < deadline:
            reaper.signal_processes(left, signal.SIGKILL)
            time.sleep(0.02)
            left = alive()
    _reap()
    return len(seen)


def _reap() -> None:
    """waitpid every child that has ended: in the keeper each child is the job's."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _say(text: str) -> None:
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass
