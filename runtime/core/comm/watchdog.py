"""The collective watchdog: a hang becomes a report and a non-zero exit, not a silent wait.

One daemon thread per rank watches the flight record (flight.py). When a collective has
been unfinished for longer than the timeout, that rank

  1. posts a trigger to the job's c10d store (the TCPStore every rank already connected
     to at init; it is served by rank 0's process or the launcher's agent and needs no
     collective, so it works while the backend is stuck, on gloo and NCCL alike);
  2. prints its own Python stacks and flight record to stderr and posts a short report;
  3. waits a few seconds for the other ranks' reports, prints one line naming where each
     rank is (`rank 1 is in all_gather #57 on world (stage3 gather blocks.2), rank 0 in
     reduce_scatter #58 on world`), and exits with status 124.

The other ranks' watchdogs poll the store for the trigger (every timeout/10, between
0.2 and 5 s); seeing it, each prints its own stacks and flight record, posts its report,
and exits 124 a moment after the first rank, so the launcher reports the first rank's
line as the failure. A rank whose interpreter cannot run this thread (blocked in C while
holding the GIL, or dead) is named as not answering. The process group is created with
a longer timeout than the watchdog's, so the backend's own timeout never fires first.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Dict, Optional

from .flight import FlightRecorder, RankReport, explain

EXIT_CODE = 124  # the status timeout(1) uses for "ran out of time"
DEFAULT_TIMEOUT_S = 30 * 60.0  # DeepSpeed's and gloo's default process-group timeout
PREFIX = "dslaunch/watchdog/"
_HERE = os.path.dirname(os.path.abspath(__file__))


def poll_interval(timeout_s: float) -> float:
    return min(5.0, max(0.2, timeout_s / 10))


def _skip_frame(filename: str) -> bool:
    return filename.startswith(_HERE) or f"{os.sep}torch{os.sep}" in filename or filename.startswith("<")


def where(thread_ident: Optional[int] = None) -> str:
    """The main thread's innermost frame outside torch and this package: the user's line."""
    ident = thread_ident if thread_ident is not None else threading.main_thread().ident
    frame = sys._current_frames().get(ident)
    first = None
    while frame is not None:
        code = frame.f_code
        here = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        first = first or here
        if not _skip_frame(code.co_filename):
            return here
        frame = frame.f_back
    return first or "?"


def stacks(skip_ident: Optional[int] = None) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip_ident:
            continue
        parts.append(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame)).rstrip())
    return "\n".join(parts)


def flight_text(rec: FlightRecorder) -> str:
    now = time.monotonic()
    lines = []
    for e in rec.entries():
        d = e.as_dict(now)
        took = f", took {d['took_s']:.3f} s" if "took_s" in d else ""
        err = f", {d['error']}" if d.get("error") else ""
        lines.append(f"  {e.describe()}: {d['nbytes']} bytes, {d['state']}, started {d['age_s']:.1f} s ago{took}{err}")
    return "\n".join(lines) or "  (no collectives yet)"


# A launcher that prefixes worker lines (dslaunch) holds a worker's stderr lines for 0.25 s and
# hides what the other workers wrote in the instant before the first failure: it is usually
# a follow-on error. A responding rank's report must not be mistaken for one.
SHOWN_AFTER_S = 0.75


def _wait_read(seconds: float) -> None:
    """Wait (at most `seconds`) until whoever reads this process's stdout and stderr pipes
    has taken everything written to them, then SHOWN_AFTER_S more, so that the launcher
    has these lines before the rank that timed out exits and is reported as the failure."""
    import fcntl
    import stat
    import struct
    import termios

    fds = []
    for fd in (1, 2):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                fds.append(fd)
        except OSError:
            pass
    deadline = time.monotonic() + seconds
    while fds and time.monotonic() < deadline:
        try:  # FIONREAD on either end of a pipe: the bytes not yet read
            unread = sum(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0] for fd in fds)
        except OSError:
            break
        if unread == 0:
            break
        time.sleep(0.02)
    time.sleep(SHOWN_AFTER_S if fds else 0.0)


def _wait_keys(store, keys, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if not keys or store.check(keys):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


class Watchdog:
    def __init__(self, recorder: FlightRecorder, rank: int, world_size: int, store_getter: Callable[[], object],
                 timeout_s: float = DEFAULT_TIMEOUT_S, stream=None, exit_fn: Callable[[int], None] = os._exit):
        self.recorder, self.rank, self.world = recorder, rank, world_size
        self.timeout_s = float(timeout_s)
        self._store_getter = store_getter
        self._stream = stream
        self._exit = exit_fn
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.store = None  # the job's store, once the thread has it

    # -- life cycle ----------------------------------------------------------------------
    def start(self) -> "Watchdog":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dslaunch-comm-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        t, self._thread = self._thread, None
        if t is not None and t is not threading.current_thread():
            t.join(timeout=10)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ------------------------------------------------------------------------
    def _store(self):
        try:
            return self._store_getter()
        except Exception:
            return None

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # a broken report must still end the hung job
            self._say(f"dslaunch.runtime: collective watchdog failed:\n{traceback.format_exc()}")
            self._exit(EXIT_CODE)

    def _watch(self) -> None:
        store = self.store = self._store() if self.world > 1 else None
        while not self._stop.wait(poll_interval(self.timeout_s)):
            e = self.recorder.oldest_pending()
            if e is not None and time.monotonic() - e.started > self.timeout_s:
                self.fire(f"rank {self.rank}: {e.describe()} did not finish within {self.timeout_s:g} s", store)
                return
            if store is not None:
                try:
                    triggered = store.check([PREFIX + "trigger"])
                except Exception:
                    return  # the store went away (the job is ending): nothing left to watch over
                if triggered:
                    self.respond(store)
                    return

    # -- reporting -----------------------------------------------------------------------
    def _say(self, text: str) -> None:
        stream = self._stream or sys.stderr
        try:
            sys.stdout.flush()  # the job's own output first; os._exit would drop it
            print(text, file=stream, flush=True)
        except Exception:
            pass

    def _dump(self, headline: str) -> RankReport:
        me = threading.current_thread().ident
        self._say(f"dslaunch.runtime: collective watchdog: {headline}\n"
                  f"--- rank {self.rank}: Python stacks ---\n{stacks(skip_ident=me)}\n"
                  f"--- rank {self.rank}: last {len(self.recorder.entries())} collectives (oldest first) ---\n"
                  f"{flight_text(self.recorder)}")
        return RankReport.of(self.rank, self.recorder, where())

    def _post(self, store, report: RankReport) -> None:
        if store is not None:
            try:
                store.set(f"{PREFIX}report/{report.rank}", json.dumps(report.to_dict()))
            except Exception:
                pass

    def _gather(self, store, mine: RankReport) -> Dict[int, RankReport]:
        reports = {mine.rank: mine}
        if store is None:
            return reports
        deadline = time.monotonic() + 2 * poll_interval(self.timeout_s) + 5.0
        while time.monotonic() < deadline and len(reports) < self.world:
            for r in range(self.world):
                if r in reports:
                    continue
                try:
                    if store.check([f"{PREFIX}report/{r}"]):
                        reports[r] = RankReport.from_dict(json.loads(store.get(f"{PREFIX}report/{r}")))
                except Exception:
                    return reports
            time.sleep(0.1)
        return reports

    def fire(self, reason: str, store=None) -> None:
        """This rank's collective timed out: alert the others, report, exit."""
        if store is not None:
            try:
                store.set(PREFIX + "trigger", reason)
            except Exception:
                store = None
        mine = self._dump(reason)
        self._post(store, mine)
        reports = self._gather(store, mine)
        unreachable = "" if store is not None else " (the store is unreachable: no other rank could be asked)"
        self._say(f"dslaunch.runtime: collective watchdog: {reason}{unreachable}\n"
                  f"dslaunch.runtime: collective watchdog: {explain(reports, self.world)}")
        if store is not None:
            try:
                store.set(PREFIX + "done", str(self.rank))
                # the others' last store calls must land before this process (maybe the
                # store's host) is gone, or they print the store's connection errors
                _wait_keys(store, [f"{PREFIX}bye/{r}" for r in reports if r != self.rank], 3.0)
            except Exception:
                pass
        self._exit(EXIT_CODE)

    def respond(self, store) -> None:
        """Another rank timed out: report this rank's state, then leave."""
        try:
            reason = store.get(PREFIX + "trigger").decode(errors="replace")
        except Exception:
            reason = "another rank's collective timed out"
        report = self._dump(f"{reason}; rank {self.rank} reports")
        _wait_read(2.0)  # the rank that timed out waits for this report before it exits
        self._post(store, report)
        try:
            _wait_keys(store, [PREFIX + "done"], 2 * poll_interval(self.timeout_s) + 5.0)
            store.set(f"{PREFIX}bye/{self.rank}", "1")
        except Exception:
            pass
        time.sleep(1.0)  # let the rank that timed out exit first: its line is the job's failure
        self._say(f"dslaunch.runtime: collective watchdog: rank {self.rank} stops ({reason})")
        self._exit(EXIT_CODE)


# -- the process's watchdog --------------------------------------------------------------------
_active: Dict[str, object] = {"dog": None, "timeout_s": DEFAULT_TIMEOUT_S}
_BACKEND_SLACK_S = 60.0  # the process group's own timeout is this much longer than ours


def _default_store():
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def timeout_s() -> float:
    return float(_active["timeout_s"])


def set_timeout(seconds: float) -> None:
    """The watchdog's timeout for every collective; the default group's own timeout is
    raised above it so the backend never gives up first."""
    import torch.distributed as dist

    if not seconds > 0:
        raise ValueError(f"comms timeout must be > 0 seconds, got {seconds}")
    _active["timeout_s"] = float(seconds)
    dog = _active["dog"]
    if dog is not None:
        dog.timeout_s = float(seconds)
    if dist.is_available() and dist.is_initialized():
        _raise_default_group_timeout(seconds)


def backend_timeout(seconds: float):
    """The timeout to give a process group so that the watchdog fires first."""
    from datetime import timedelta

    return timedelta(seconds=seconds + _BACKEND_SLACK_S)


def _raise_default_group_timeout(seconds: float) -> None:
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(backend_timeout(seconds), None)
    except Exception:  # an older torch, or a backend without a settable timeout
        pass


def ensure(recorder: FlightRecorder) -> None:
    """Start this process's watchdog once torch.distributed is up with more than one rank
    (again after the default group was destroyed and made anew)."""
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    dog = _active["dog"]
    if dog is not None and _active.get("world") is world:
        return
    stop()
    if world is None or dist.get_world_size() < 2:
        return
    _active["world"] = world
    _active["dog"] = Watchdog(recorder, dist.get_rank(), dist.get_world_size(), _default_store,
                              timeout_s()).start()


def stop(leaving: bool = False, failed: bool = False) -> None:
    """Stop the watchdog. `leaving` (at interpreter exit): also tell the job this rank is
    done with the store, and on rank 0 (usually the store's host) wait up to 30 s for the
    others to say the same, so that no rank's watchdog polls a store that is gone."""
    dog, _active["dog"], _active["world"] = _active["dog"], None, None
    if dog is None:
        return
    dog.stop()
    if leaving and dog.store is not None:
        try:
            dog.store.set(f"{PREFIX}exit/{dog.rank}", "1")
            if dog.rank == 0 and not failed:
                _wait_keys(dog.store, [f"{PREFIX}exit/{r}" for r in range(dog.world)], 30.0)
        except Exception:
            pass
