"""Orphan guard: a tiny process that outlives a SIGKILLed supervisor and ends its job.

The supervisor starts this file as a script (`python -S watchdog.py GRACE`), in its own
session so terminal signals and process-group kills aimed at the launcher miss it, and
keeps the write end of its stdin. Over that pipe it announces each worker's process group
(`pgid N`) and the environment marker every worker inherits (`marker KEY=VALUE`). A clean
supervisor says `done` before closing the pipe. If the pipe closes without `done`, the
supervisor died without cleaning up: the watchdog sends SIGTERM to every announced group
and to every process carrying the marker (which catches grandchildren that left the
group with setsid), waits the grace period, then SIGKILLs whatever is left.

PR_SET_PDEATHSIG on the workers covers the direct children faster; this covers the rest.
Standard library only and no package imports, so it starts in a few milliseconds.
"""
import os
import signal
import sys
import time


def _marked_pids(marker: bytes):
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    yield int(name)
        except OSError:
            continue


def _signal_all(pgids, marker, sig) -> bool:
    """Signal everything of the job; True if anything was still alive."""
    alive = False
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
            alive = True
        except OSError:
            pass
    if marker:
        for pid in _marked_pids(marker):
            try:
                os.kill(pid, sig)
                alive = True
            except OSError:
                pass
    return alive


def main() -> int:
    grace = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pgids, marker = [], b""
    for raw in sys.stdin.buffer:
        line = raw.rstrip(b"\n")
        if line == b"done":
            return 0
        if line.startswith(b"pgid "):
            pgids.append(int(line[5:]))
        elif line.startswith(b"marker "):
            marker = line[7:]
    # EOF without "done": the supervisor is gone.
    if not _signal_all(pgids, marker, signal.SIGTERM):
        return 0
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if not _signal_all(pgids, marker, 0):
            return 0
    _signal_all(pgids, marker, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
