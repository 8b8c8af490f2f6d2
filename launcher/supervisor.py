"""Local worker-group supervision: start, stream, watch, tear down. One attempt.

The group is the unit (as in torch elastic): it succeeds when every worker exits 0, and
the first worker to fail fails the group, which is then torn down as a whole. Restarts
are the caller's business (a new Supervisor per attempt), so a remote node agent can run
exactly one attempt per request from the head.

Teardown: SIGTERM (or the signal the caller was asked to forward) to each worker's process
group and to every descendant found, immediately; SIGKILL to whatever survives the grace
period. Descendants that escaped the group with setsid are still found because the
supervisor is a child subreaper; after a SIGKILL of the supervisor itself, the watchdog
process and the workers' parent-death signal take over (see reaper.py, watchdog.py).

Output: every worker's stdout and stderr are separate pipes read by one selector loop,
cut into whole lines and handed to the caller's observer as OutputLines, so lines from
different workers never interleave mid-line and stderr stays stderr. The observer must not
block (output.JobOutput and the node agent's event stream both queue and return): this
loop is also what reacts to failures and stop requests.

In each round the loop looks at exits before it reads pipes, so a worker that fails is
known (and the observer told) before the lines other workers wrote in the same instant
are handed over; the console can then treat those as follow-on errors.

Which worker failed first is not always which exited first. A rank that raises in a
script using dslaunch.runtime prints its traceback and then spends a while in the
runtime's exit handler (destroying its process groups); its peers, waiting in a
collective, fail the moment its connections close and may well exit before it does. So
every worker gets the write end of a pipe (its fd in $DSLAUNCH_ORIGIN_FD), and the
runtime's excepthook writes one line there before anything else happens. The first
worker heard from that way is the origin: the observer is told at once (a failure with
the exit code of an uncaught exception, 1), the non-zero exits of other workers that
follow are follow-ons, and the group is torn down when the origin has exited (its real
exit code and stderr then make the failure) or ORIGIN_WAIT_S after it raised. Scripts
that do not use the runtime write nothing there and are judged by their exits alone.

The other way round, a worker killed by a signal (kill -9, the OOM killer, a crash) never
announces anything, and its peers raise because its sockets closed: their announcements
can reach the supervisor in the same instant as its death, or first. The kernel marks a
process as exiting before it closes its files, so when an announcement is read while
another worker is already exiting or dead by a signal, that death came first: it is the
failure, and the announcement a follow-on.
"""
from __future__ import annotations

import enum
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from dslaunch.launcher import reaper
from dslaunch.launcher.failure import Failure
from dslaunch.launcher.output import STDERR, STDOUT, OutputLine

# Marks every process of one group in its environment; the watchdog finds escaped
# grandchildren by it. Unique per attempt so two jobs on one host never touch each other.
GROUP_MARKER_VAR = "DSLAUNCH_GROUP_ID"
_MAX_PARTIAL_LINE = 1 << 20  # a "line" longer than this is emitted in pieces rather than buffered forever
# runtime/core/comm/shutdown.ORIGIN_FD_VAR: the fd a worker's runtime writes to when it raises
ORIGIN_FD_VAR = "DSLAUNCH_ORIGIN_FD"
# How long a worker that raised may take to exit (the runtime's own shutdown after an
# uncaught exception is bounded at 10 s) before the group is torn down anyway.
ORIGIN_WAIT_S = 15.0
UNCAUGHT_EXCEPTION_CODE = 1  # how Python exits after an uncaught exception
# How long a worker found exiting may take to be gone. Its files are closed late in its exit
# (after its memory is freed), so a peer's announcement caused by that means little is left.
EXITING_WAIT_S = 2.0


class WorkerState(enum.Enum):
    """Lifecycle of one worker; the group moves through the same states as a unit.

    INIT -> HEALTHY when its process started (INIT -> FAILED if it could not be started).
    HEALTHY -> SUCCEEDED on exit 0, FAILED on a non-zero exit or a death by signal that
    the supervisor did not cause, STOPPED when it ended after the supervisor began a
    teardown (the group failed elsewhere, or a stop was requested).
    A group is SUCCEEDED only if every worker is; FAILED if any worker FAILED first;
    STOPPED if a stop request ended it before any failure.
    """

    INIT = "init"
    HEALTHY = "healthy"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class WorkerSpec:
    rank: int
    argv: List[str]
    env: Dict[str, str]  # the complete environment of the worker
    label: str = ""  # how output and reports name it; defaults to "rank N"
    cwd: Optional[str] = None
    cpus: Optional[Tuple[int, ...]] = None  # pin every thread of the worker to these cores

    def __post_init__(self):
        if not self.label:
            self.label = f"rank {self.rank}"


class GroupObserver(Protocol):
    """What a running group tells its owner; every method must return at once."""

    def line(self, line: OutputLine) -> None: ...

    def failed(self, failure: Failure) -> None:
        """The first failure, before teardown starts (a node agent reports it to the head
        at once, so the other nodes stop within the same second)."""

    def exited(self, label: str) -> None: ...


@dataclass
class GroupResult:
    state: WorkerState
    exit_codes: Dict[int, Optional[int]]  # rank -> shell-style exit code (None: never started)
    states: Dict[int, WorkerState]
    failure: Optional[Failure] = None
    stop_signal: Optional[int] = None  # the stop request that ended the group, if any
    teardown_s: Optional[float] = None  # first teardown signal -> last worker gone

    @property
    def exit_code(self) -> int:
        if self.failure is not None:
            return self.failure.exit_code
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        return 0


@dataclass
class _Worker:
    spec: WorkerSpec
    state: WorkerState = WorkerState.INIT
    proc: Optional[subprocess.Popen] = None
    pidfd: Optional[int] = None
    started: float = 0.0
    exit_code: Optional[int] = None
    origin_fd: Optional[int] = None  # read end of the pipe the worker's runtime announces an exception on
    partial: Dict[str, bytearray] = field(default_factory=lambda: {STDOUT: bytearray(), STDERR: bytearray()})
    tail: Deque[str] = field(default_factory=lambda: deque(maxlen=20))


class Supervisor:
    """Runs one attempt of a worker group. Use from one thread; request_stop() from any."""

    def __init__(self, specs: Sequence[WorkerSpec], observer: GroupObserver, *, kill_grace: float = 5.0,
                 stderr_tail_lines: int = 20, subreaper: bool = True, watchdog: bool = True):
        if not specs:
            raise ValueError("a worker group needs at least one worker")
        self.kill_grace = kill_grace
        self._observer = observer
        self._workers = [_Worker(s, tail=deque(maxlen=stderr_tail_lines)) for s in specs]
        self._subreaper = subreaper
        self._use_watchdog = watchdog
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop_signal: Optional[int] = None
        self._force_kill = False
        self._watchdog: Optional[subprocess.Popen] = None
        self._marker = f"{GROUP_MARKER_VAR}={uuid.uuid4().hex}"
        self._origin: Optional[_Worker] = None  # the first worker whose runtime said it raised
        self._origin_at = 0.0

    # -- public -------------------------------------------------------------------------

    def request_stop(self, signum: int = signal.SIGTERM, *, force: bool = False) -> None:
        """Forward `signum` to every worker and end the attempt. Safe in a signal handler.

        Repeated requests are harmless; force=True (Ctrl-C pressed again) skips the rest
        of the grace period and SIGKILLs at once.
        """
        if self._stop_signal is None:
            self._stop_signal = signum
        if force:
            self._force_kill = True
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    def run(self) -> GroupResult:
        # The caller's signal handlers (Ctrl-C, a node agent's SIGTERM) run in the main thread
        # only, but the kernel may deliver the signal to any thread (an output writer, a
        # heartbeat): the main thread would then sleep on in select() with the handler
        # pending, until something else woke it. Python writes every signal's number to the
        # wakeup fd, so the loop wakes and the handler runs at once.
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        try:
            return self._run()
        finally:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(self._wake_r)
            os.close(self._wake_w)

    @property
    def pids(self) -> List[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    # -- the loop -----------------------------------------------------------------------

    def _run(self) -> GroupResult:
        # Children this process had before the job (a program that embeds the supervisor may
        # run others: a test runner's servers) are not the job's: teardown leaves their trees be.
        self._foreign_children = set(reaper.descendants(os.getpid()))
        if self._subreaper:
            reaper.become_subreaper()
        self._start_watchdog()
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        failure: Optional[Failure] = None
        teardown_at: Optional[float] = None
        killed = False
        done_at = time.monotonic()
        try:
            marker_key, _, marker_value = self._marker.partition("=")
            for w in self._workers:
                if self._stop_signal is not None:
                    break
                failure = self._spawn(w, sel, marker_key, marker_value) or failure
                if failure is not None:
                    break
            if failure is not None or self._stop_signal is not None:
                teardown_at = self._begin_teardown(failure)
            while any(w.state is WorkerState.HEALTHY for w in self._workers):
                timeout = None
                if teardown_at is not None and not killed:
                    timeout = max(0.0, teardown_at + self.kill_grace - time.monotonic())
                elif any(w.pidfd is None for w in self._workers if w.state is WorkerState.HEALTHY):
                    timeout = 0.05  # no pidfd support: poll exits
                if teardown_at is None and self._origin is not None:
                    wait = max(0.0, self._origin_at + ORIGIN_WAIT_S - time.monotonic())
                    timeout = wait if timeout is None else min(timeout, wait)
                ready = sel.select(timeout)
                # an announced exception first, then exits: a failure is known before the
                # lines others wrote meanwhile are handed on
                for key, _ in ready:
                    if key.data[0] == "exit":
                        sel.unregister(key.fd)
                    elif key.data[0] == "wake":
                        self._drain_wake()
                self._poll_origins(sel, may_name=teardown_at is None)
                for w in self._workers:
                    if w.state is WorkerState.HEALTHY and w.proc.poll() is not None:
                        if teardown_at is None and w.proc.returncode != 0:
                            self._poll_origins(sel, may_name=True)  # the origin's line may not have woken us yet
                        failed = self._exited(w, sel, tearing_down=teardown_at is not None)
                        if failed and failure is None:
                            failure = failed
                if (failure is None and teardown_at is None and self._origin is not None
                        and time.monotonic() >= self._origin_at + ORIGIN_WAIT_S):
                    failure = self._origin_failure(self._origin, reason=(
                        f"raised an uncaught exception and had not exited {ORIGIN_WAIT_S:g}s later"))
                if teardown_at is None and (failure is not None or self._stop_signal is not None):
                    teardown_at = self._begin_teardown(failure)
                for key, _ in ready:
                    kind, w = key.data
                    if kind in (STDOUT, STDERR) and key.fd in sel.get_map():
                        self._read(sel, key.fd, w, kind)
                if (teardown_at is not None and not killed
                        and (self._force_kill or time.monotonic() >= teardown_at + self.kill_grace)):
                    self._signal_everything(signal.SIGKILL)
                    killed = True
            done_at = time.monotonic()
            self._sweep_leftovers(killed)
            self._finish_output(sel)
        finally:
            if any(w.state is WorkerState.HEALTHY for w in self._workers):
                # An exception escaped the loop: never leave the group running.
                self._signal_everything(signal.SIGKILL)
                for w in self._workers:
                    if w.proc is not None:
                        w.proc.wait()
            for w in self._workers:
                if w.pidfd is not None:
                    os.close(w.pidfd)
                    w.pidfd = None
                if w.origin_fd is not None:
                    os.close(w.origin_fd)
                    w.origin_fd = None
            sel.close()
            self._stop_watchdog()
        return self._result(failure, teardown_at, done_at)

    def _spawn(self, w: _Worker, sel, marker_key: str, marker_value: str) -> Optional[Failure]:
        env = dict(w.spec.env)
        env[marker_key] = marker_value
        origin_r, origin_w = os.pipe()
        env[ORIGIN_FD_VAR] = str(origin_w)
        w.started = time.monotonic()
        try:
            w.proc = subprocess.Popen(
                w.spec.argv, env=env, cwd=w.spec.cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=reaper.make_child_setup(cpus=w.spec.cpus), pass_fds=(origin_w,),
            )
        except (OSError, ValueError) as e:
            os.close(origin_r)
            os.close(origin_w)
            # Nothing ran; report it like a shell would (126 not executable, 127 not found).
            code = 127 if isinstance(e, FileNotFoundError) else 126
            w.state, w.exit_code = WorkerState.FAILED, code
            why = getattr(e, "strerror", None) or str(e)
            msg = f"cannot start {w.spec.argv[0]!r}: {why}"
            w.tail.append(msg)
            self._observer.line(OutputLine(w.spec.rank, w.spec.label, STDERR, msg.encode() + b"\n"))
            return Failure(w.spec.rank, w.spec.label, code, reason=msg, stderr_tail=tuple(w.tail), elapsed_s=0.0)
        os.close(origin_w)
        os.set_blocking(origin_r, False)
        w.origin_fd = origin_r
        sel.register(origin_r, selectors.EVENT_READ, ("origin", w))
        w.state = WorkerState.HEALTHY
        self._announce(f"pgid {w.proc.pid}")
        for stream, pipe in ((STDOUT, w.proc.stdout), (STDERR, w.proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe.fileno(), selectors.EVENT_READ, (stream, w))
        try:
            w.pidfd = os.pidfd_open(w.proc.pid)
            sel.register(w.pidfd, selectors.EVENT_READ, ("exit", w))
        except (AttributeError, OSError):
            w.pidfd = None
        return None

    def _read(self, sel, fd: int, w: _Worker, stream: str) -> bool:
        """One read from a worker pipe; False when nothing was there (EAGAIN or EOF)."""
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not data:
            sel.unregister(fd)
            self._flush_partial(w, stream)
            return False
        buf = w.partial[stream]
        buf += data
        # '\r' ends a line too, so progress bars (tqdm) show up as they update. A trailing
        # '\r' waits for the next read: it may be the first half of '\r\n'.
        end = max(buf.rfind(b"\n"), buf.rfind(b"\r", 0, len(buf) - 1))
        if end >= 0:
            for line in bytes(buf[: end + 1]).splitlines(keepends=True):
                self._emit(w, stream, line)
            del buf[: end + 1]
        if len(buf) > _MAX_PARTIAL_LINE:
            self._flush_partial(w, stream)
        return True

    def _emit(self, w: _Worker, stream: str, line: bytes) -> None:
        if stream == STDERR:
            w.tail.append(line.decode("utf-8", "replace").rstrip("\r\n"))
        self._observer.line(OutputLine(w.spec.rank, w.spec.label, stream, line))

    def _flush_partial(self, w: _Worker, stream: str) -> None:
        buf = w.partial[stream]
        if buf:
            self._emit(w, stream, bytes(buf) + b"\n")
            buf.clear()

    def _drain(self, sel, w: _Worker) -> None:
        """Read what a dead worker left in its pipes, so its last lines precede any report.

        Bounded: a grandchild that inherited the pipe may still be writing.
        """
        for stream, pipe in ((STDOUT, w.proc.stdout), (STDERR, w.proc.stderr)):
            fd = pipe.fileno()
            for _ in range(256):
                if fd not in sel.get_map() or not self._read(sel, fd, w, stream):
                    break

    def _exited(self, w: _Worker, sel, tearing_down: bool) -> Optional[Failure]:
        rc = w.proc.returncode
        w.exit_code = reaper.exit_code_of(rc)
        self._drain(sel, w)
        if w is self._origin and not tearing_down:
            w.state = WorkerState.FAILED
            if rc == 0:  # it raised, yet something made it exit 0: still the failure it announced
                return self._origin_failure(w, reason="raised an uncaught exception (then exited with code 0)")
            sig = -rc if rc < 0 else None
            return Failure(w.spec.rank, w.spec.label, w.exit_code, signal=sig, stderr_tail=tuple(w.tail),
                           elapsed_s=time.monotonic() - w.started)
        if rc != 0 and not tearing_down and self._origin is None:
            w.state = WorkerState.FAILED
            sig = -rc if rc < 0 else None
            return Failure(w.spec.rank, w.spec.label, w.exit_code, signal=sig, stderr_tail=tuple(w.tail),
                           elapsed_s=time.monotonic() - w.started)
        self._observer.exited(w.spec.label)
        if rc != 0 and self._origin is not None and not tearing_down:
            w.state = WorkerState.STOPPED  # a follow-on of the origin's exception
            return None
        # once the teardown began, whatever it exited with, we stopped it
        w.state = WorkerState.SUCCEEDED if rc == 0 and not tearing_down else WorkerState.STOPPED
        return None

    def _poll_origins(self, sel, may_name: bool) -> None:
        """Read every worker's origin pipe; the first worker that announced an exception,
        while nothing has failed or been stopped yet (may_name), is the origin and the
        observer is told now."""
        for w in self._workers:
            if w.origin_fd is None:
                continue
            try:
                data = os.read(w.origin_fd, 4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # EOF: it (and every process that inherited the pipe) is gone
                sel.unregister(w.origin_fd)
                os.close(w.origin_fd)
                w.origin_fd = None
            elif may_name and self._origin is None and w.state is WorkerState.HEALTHY and self._stop_signal is None:
                if self._killed_peer(w):
                    continue  # a follow-on of a peer's death, which the exit check reports
                self._origin, self._origin_at = w, time.monotonic()
                self._observer.failed(self._origin_failure(w))

    def _killed_peer(self, announcer: _Worker) -> bool:
        """Whether another worker is dead by a signal, or exiting and then found so, at the
        moment `announcer`'s exception is heard of (see "Which worker failed first")."""
        for w in self._workers:
            if w is announcer or w.state is not WorkerState.HEALTHY:
                continue
            rc = w.proc.poll()
            if rc is None and reaper.exiting(w.proc.pid):
                try:
                    rc = w.proc.wait(timeout=EXITING_WAIT_S)
                except subprocess.TimeoutExpired:
                    rc = None
            if rc is not None and rc < 0:
                return True
        return False

    def _origin_failure(self, w: _Worker, reason: str = "") -> Failure:
        """The origin's failure before its exit is seen: the exit code of an uncaught exception."""
        return Failure(w.spec.rank, w.spec.label, UNCAUGHT_EXCEPTION_CODE, reason=reason, stderr_tail=tuple(w.tail),
                       elapsed_s=time.monotonic() - w.started)

    # -- teardown -----------------------------------------------------------------------

    def _begin_teardown(self, failure: Optional[Failure]) -> float:
        if failure is not None and (self._origin is None or failure.rank != self._origin.spec.rank):
            self._observer.failed(failure)  # (an origin's failure was told when it raised)
        sig = signal.SIGTERM if failure is not None or self._stop_signal is None else self._stop_signal
        self._signal_everything(sig)
        return time.monotonic()

    def _signal_everything(self, sig: int) -> None:
        """Signal every worker's group, every descendant, and every adopted orphan.

        A process in one of the signalled groups is not signalled a second time: a second
        SIGINT that lands after the first was handled raises a second KeyboardInterrupt,
        inside the worker's exit handlers."""
        live = [w.proc.pid for w in self._workers if w.proc is not None]
        reaper.signal_groups(live, sig)
        reaper.signal_processes([p for p in self._job_descendants() if reaper.group_of(p) not in live], sig)

    def _job_descendants(self) -> List[int]:
        skip = {self._watchdog.pid} if self._watchdog is not None else set()
        return [p for p in reaper.descendants(os.getpid(), exclude=getattr(self, "_foreign_children", ()))
                if p not in skip and reaper.alive(p)]

    def _sweep_leftovers(self, killed: bool) -> None:
        """Workers are gone; end anything they left behind (daemons, escaped grandchildren)."""
        leftovers = self._job_descendants()
        if not leftovers:
            self._reap_adopted()
            return
        if not killed:
            reaper.signal_processes(leftovers, signal.SIGTERM)
            reaper.signal_groups([w.proc.pid for w in self._workers if w.proc is not None], signal.SIGTERM)
            deadline = time.monotonic() + self.kill_grace
            while time.monotonic() < deadline:
                self._reap_adopted()
                if not self._job_descendants():
                    return
                time.sleep(0.02)
        reaper.signal_processes(self._job_descendants(), signal.SIGKILL)
        reaper.signal_groups([w.proc.pid for w in self._workers if w.proc is not None], signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while self._job_descendants() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._reap_adopted()

    def _reap_adopted(self) -> None:
        mine = {w.proc.pid for w in self._workers if w.proc is not None}
        if self._watchdog is not None:
            mine.add(self._watchdog.pid)
        reaper.reap(p for p in reaper.children(os.getpid()) if p not in mine)

    def _finish_output(self, sel) -> None:
        """Every process of the group is gone: read the pipes to EOF and close them."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            keys = [k for k in sel.get_map().values() if k.data[0] in (STDOUT, STDERR)]
            if not keys:
                break
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                kind, w = key.data
                if kind in (STDOUT, STDERR):
                    self._read(sel, key.fd, w, kind)
                elif kind == "wake":
                    self._drain_wake()
                elif kind == "origin":
                    self._poll_origins(sel, may_name=False)
        for w in self._workers:
            for stream in (STDOUT, STDERR):
                self._flush_partial(w, stream)
            if w.proc is not None:
                for pipe in (w.proc.stdout, w.proc.stderr):
                    try:
                        sel.unregister(pipe.fileno())
                    except (KeyError, ValueError):
                        pass
                    pipe.close()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # -- watchdog -----------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        if not self._use_watchdog:
            return
        script = Path(__file__).with_name("watchdog.py")
        self._watchdog = subprocess.Popen(
            [sys.executable, "-S", "-E", str(script), str(self.kill_grace)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._announce(f"marker {self._marker}")

    def _announce(self, line: str) -> None:
        if self._watchdog is not None:
            try:
                self._watchdog.stdin.write(line.encode() + b"\n")
                self._watchdog.stdin.flush()
            except OSError:
                pass

    def _stop_watchdog(self) -> None:
        if self._watchdog is None:
            return
        self._announce("done")
        try:
            self._watchdog.stdin.close()
        except OSError:
            pass
        try:
            self._watchdog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._watchdog.kill()
            self._watchdog.wait()

    def _result(self, failure, teardown_at, done_at) -> GroupResult:
        states = {w.spec.rank: w.state for w in self._workers}
        codes = {w.spec.rank: w.exit_code for w in self._workers}
        if failure is not None:
            group = WorkerState.FAILED
        elif self._stop_signal is not None:
            group = WorkerState.STOPPED
        else:
            group = WorkerState.SUCCEEDED
        # A worker that was never spawned (stop arrived, or an earlier spawn failed) is STOPPED.
        for w in self._workers:
            if w.state is WorkerState.INIT:
                states[w.spec.rank] = WorkerState.STOPPED
        teardown_s = (done_at - teardown_at) if teardown_at is not None else None
        return GroupResult(group, codes, states, failure, self._stop_signal if failure is None else None, teardown_s)
