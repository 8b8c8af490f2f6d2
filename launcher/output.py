"""Where a job's lines go: the console (one thread, in order, never blocking supervision)
and one log file per rank; what the console shows once a worker has failed.

Every worker line reaches the head as an OutputLine, from the local supervisor or from a
node agent alike. JobOutput takes lines, failures and the launcher's own messages from
any thread without blocking (the console thread and each log file's writer do the
blocking writes, see writer.py) and applies one policy:

- Before any failure every line is shown as `[rank N] ...` (`[host:N]` from other hosts),
  stdout to stdout and stderr to stderr, colours only on a terminal.
- A stderr block that starts with "Traceback (most recent call last):" is held back for up
  to HOLD_S seconds, or until its worker exits: when another worker fails first, that
  traceback is a follow-on error (a gloo "Connection closed by peer", the same config
  error raised on every rank) and is not shown.
- After the first failure the console shows only the failing worker's lines; each other
  worker's lines are counted, and the summary names it once: `rank 0: stopped after rank 1
  failed; 22 lines not shown, all in logs/rank_0.log`.
- Log files get every line, prefix-free, whatever the console does.
- torch's own `[rankN]: ` excepthook prefix is dropped on the console where ours says the same.
- When the console reader is too slow and CONSOLE_BUFFER bytes are waiting, further
  worker lines are dropped from the console (never from the log files) and counted; the
  count is reported at the end. The launcher's own messages are never dropped.
"""
from __future__ import annotations

import collections
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.failure import Failure
from dslaunch.launcher.writer import BoundedWriter

STDOUT, STDERR = "stdout", "stderr"
HOLD_S = 2.0
CONSOLE_BUFFER = 8 << 20
LOG_BUFFER = 32 << 20
_COLOURS = (b"\x1b[36m", b"\x1b[33m", b"\x1b[35m", b"\x1b[32m", b"\x1b[34m", b"\x1b[91m", b"\x1b[96m", b"\x1b[93m")
_RESET = b"\x1b[0m"
_TRACEBACK = b"Traceback (most recent call last):"
_TORCH_PREFIX = re.compile(rb"^\[rank(\d+)\]: ?")


@dataclass(frozen=True)
class OutputLine:
    """One whole line of one worker; `data` keeps its line ending (b"\\n", b"\\r\\n" or b"\\r")."""

    rank: int
    label: str  # "rank 3" on this machine, "host:3" from another host
    stream: str  # STDOUT or STDERR
    data: bytes


def say(err: BinaryIO, text: str) -> None:
    """The launcher's own message outside a running job (before the start, after the end)."""
    try:
        err.write("".join(f"dslaunch: {line}\n" for line in text.splitlines()).encode())
        err.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass


def check_log_dir(path: str) -> None:
    """Create --log_dir and prove it writable before anything starts."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".dslaunch-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise LaunchConfigError(f"--log_dir {path}: cannot write there ({e.strerror or e})") from None


def _wants_colour(stream: BinaryIO) -> bool:
    try:
        return stream.isatty() and "NO_COLOR" not in os.environ
    except (AttributeError, ValueError):
        return False


class LogDirSink:
    """One file per rank, `rank_<N>.log`, both streams in arrival order, appended across runs."""

    def __init__(self, log_dir: str, ranks: Sequence[int], header: str):
        self.dir = Path(log_dir)
        self._files: Dict[int, Tuple[BinaryIO, BoundedWriter]] = {}
        for r in ranks:
            f = open(self.dir / f"rank_{r}.log", "ab", buffering=0)
            w = BoundedWriter(f, LOG_BUFFER, name=f"dslaunch-log-{r}", flush=False)
            w.write(f"=== {header} ===\n".encode(), force=True)
            self._files[r] = (f, w)

    def path(self, rank: int) -> Path:
        return self.dir / f"rank_{rank}.log"

    def write(self, line: OutputLine) -> None:
        entry = self._files.get(line.rank)
        if entry is not None:
            entry[1].write(line.data)

    @property
    def dropped(self) -> int:
        return sum(w.dropped for _, w in self._files.values())

    def close(self) -> None:
        for f, w in self._files.values():
            w.close(timeout=10)
            f.close()


@dataclass
class _Hold:
    deadline: float
    lines: List[OutputLine] = field(default_factory=list)


@dataclass(frozen=True)
class AttemptSummary:
    """What the summary after a failed attempt says, besides the failure itself."""

    failure: Failure
    ended: Mapping[str, str]  # label -> "stopped" | "failed" | "succeeded" for the other workers
    total: int


class JobOutput:
    """The head's output for a whole job (all attempts). Thread-safe; never blocks the caller."""

    def __init__(self, out: BinaryIO, err: BinaryIO, log_dir: Optional[str] = None, run_id: str = "",
                 hold_s: float = HOLD_S, capacity: int = CONSOLE_BUFFER):
        self._streams = {STDOUT: (out, _wants_colour(out)), STDERR: (err, _wants_colour(err))}
        self._log_dir = log_dir
        self._run_id = run_id
        self._hold_s = hold_s
        self._capacity = capacity
        self._logs: Optional[LogDirSink] = None
        self._events: Deque[tuple] = collections.deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0  # worker lines the console could not take
        # console-thread state, reset per attempt
        self._failure: Optional[Failure] = None
        self._hidden: Dict[str, int] = {}
        self._ranks: Dict[str, int] = {}
        self._stderr_shown: set = set()
        self._holds: Dict[str, _Hold] = {}
        self._gone: set = set()  # streams whose reader went away
        self._thread = threading.Thread(target=self._loop, name="dslaunch-console", daemon=True)
        self._thread.start()

    # -- producers (any thread) ------------------------------------------------------------

    def start_attempt(self, restart: int, ranks: Sequence[int]) -> None:
        if self._log_dir:
            if self._logs is not None:
                self._logs.close()
            self._logs = LogDirSink(self._log_dir, ranks, f"dslaunch run {self._run_id} restart {restart}")
        self._put(("attempt",), force=True)

    def line(self, line: OutputLine) -> None:
        logs = self._logs
        if logs is not None:
            logs.write(line)
        self._put(("line", line), size=len(line.data))

    def failed(self, failure: Failure) -> None:
        self._put(("failed", failure), force=True)

    def exited(self, label: str) -> None:
        self._put(("exited", label), force=True)

    def say(self, text: str) -> None:
        self._put(("say", text), force=True)

    def summary(self, summary: AttemptSummary) -> None:
        self._put(("summary", summary), force=True)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Show what is queued, report drops, close the logs. False if the console did not
        drain within timeout (a reader that stopped reading): the rest is abandoned."""
        if self._logs is not None:
            self._logs.close()
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _put(self, event: tuple, size: int = 0, force: bool = False) -> None:
        with self._cond:
            if self._closed:
                return
            if not force and self._pending + size > self._capacity:
                self.dropped += 1
                return
            self._pending += size
            self._events.append((event, size))
            self._cond.notify()

    # -- the console thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._events and not self._closed:
                    timeout = self._next_deadline()
                    if timeout is not None and timeout <= 0:
                        break
                    self._cond.wait(timeout)
                batch = list(self._events)
                self._events.clear()
                closing = self._closed and not batch
            for event, size in batch:
                getattr(self, "_on_" + event[0])(*event[1:])
                with self._cond:
                    self._pending -= size
            self._release_expired(time.monotonic())
            if closing:
                for label in list(self._holds):
                    self._release(label)
                if self.dropped:
                    where = f"every line is in {self._log_dir}" if self._log_dir else "--log_dir keeps every line"
                    self._say_now(f"{self.dropped} worker line(s) were not shown: the console did not keep up ({where})")
                return

    def _next_deadline(self) -> Optional[float]:
        if not self._holds:
            return None
        return min(h.deadline for h in self._holds.values()) - time.monotonic()

    def _on_attempt(self) -> None:
        for label in list(self._holds):
            self._release(label)
        self._failure = None
        self._hidden.clear()
        self._stderr_shown.clear()

    def _on_line(self, line: OutputLine) -> None:
        self._ranks[line.label] = line.rank
        f = self._failure
        if f is not None and line.label != f.label:
            self._hidden[line.label] = self._hidden.get(line.label, 0) + 1
            return
        if line.stream == STDERR:
            hold = self._holds.get(line.label)
            if hold is not None:
                hold.lines.append(line)
                return
            if f is None and self._strip(line).startswith(_TRACEBACK):
                self._holds[line.label] = _Hold(time.monotonic() + self._hold_s, [line])
                return
        self._show(line)

    def _on_failed(self, failure: Failure) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        self._release(failure.label)
        for label in list(self._holds):
            self._release(label)  # now hidden: another worker failed first

    def _on_exited(self, label: str) -> None:
        self._release(label)

    def _on_say(self, text: str) -> None:
        self._say_now(text)

    def _on_summary(self, s: AttemptSummary) -> None:
        f = s.failure
        lines = [f.describe()]
        if f.stderr_tail and f.label not in self._stderr_shown:
            lines.append(f"last {len(f.stderr_tail)} line(s) of {f.label}'s stderr:")
            lines += [f"  | {t}" for t in f.stderr_tail]
        for label, state in s.ended.items():
            hidden = self._hidden.get(label, 0)
            if not hidden:
                continue
            how = f"stopped after {f.label} failed" if state == "stopped" else f"also {state}"
            rank = self._ranks.get(label)
            where = (f", all in {Path(self._log_dir) / f'rank_{rank}.log'}" if self._log_dir and rank is not None
                     else " (--log_dir keeps them)")
            lines.append(f"{label}: {how}; {hidden} line(s) not shown{where}")
        stopped = sum(1 for state in s.ended.values() if state == "stopped")
        if stopped:
            lines.append(f"stopped the other {stopped} of {s.total} worker(s)")
        self._say_now("\n".join(lines))

    def _release(self, label: str) -> None:
        hold = self._holds.pop(label, None)
        if hold is None:
            return
        f = self._failure
        if f is not None and label != f.label:
            self._hidden[label] = self._hidden.get(label, 0) + len(hold.lines)
            return
        for line in hold.lines:
            self._show(line)

    def _release_expired(self, now: float) -> None:
        for label in [k for k, h in self._holds.items() if h.deadline <= now]:
            self._release(label)

    def _strip(self, line: OutputLine) -> bytes:
        m = _TORCH_PREFIX.match(line.data)
        if m and int(m.group(1)) == line.rank:
            return line.data[m.end():]
        return line.data

    def _show(self, line: OutputLine) -> None:
        if line.stream == STDERR:
            self._stderr_shown.add(line.label)
        target, colour = self._streams[line.stream]
        prefix = f"[{line.label}] ".encode()
        if colour:
            prefix = _COLOURS[line.rank % len(_COLOURS)] + prefix[:-1] + _RESET + b" "
        self._write(target, prefix + self._strip(line))

    def _say_now(self, text: str) -> None:
        data = "".join(f"dslaunch: {t}\n" for t in text.splitlines()).encode()
        self._write(self._streams[STDERR][0], data)

    def _write(self, target: BinaryIO, data: bytes) -> None:
        if id(target) in self._gone:
            return
        try:
            target.write(data)
            target.flush()
        except (BrokenPipeError, ValueError, OSError):
            # `dslaunch ... | head`: the reader left; keep supervising, stop printing there
            self._gone.add(id(target))
