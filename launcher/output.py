"""Where a job's lines go: the console (one thread, in order, never blocking supervision)
and one log file per rank; what the console shows once a worker has failed.

Every worker line reaches the head as an OutputLine, from the local supervisor or from a
node agent alike. JobOutput takes lines, failures and the launcher's own messages from
any thread without blocking (the console thread and each log file's writer do the
blocking writes, see writer.py) and applies one policy:

- Before any failure every line is shown as `[rank N] ...` (`[host:N]` from other hosts),
  stdout to stdout and stderr to stderr, colours only on a terminal.
- stdout lines are shown as they come. stderr lines reach the console DELAY_S (0.25 s)
  after they arrived, in arrival order, and a stderr block that starts with "Traceback
  (most recent call last):" up to TRACEBACK_S (2 s) later, or when its worker exits. When a worker fails, what the others wrote in
  that moment is a follow-on error (a gloo "Connection closed by peer", the same config
  error raised on every rank a few milliseconds apart) and is not shown.
- After the first failure the console shows only the failing worker's lines; each other
  worker's lines are counted, and the summary names it once: `rank 0: stopped after rank 1
  failed; 22 lines not shown, all in logs/rank_0.log`.
- Log files get every line, prefix-free, whatever the console does, byte for byte.
- On the console a worker's line is text: control characters (C0 but tab, DEL, C1) are shown
  escaped as `\x1b`, so no worker can set the terminal's title, clear the screen, move
  the cursor over a prefix or write in another rank's name; colour (SGR: `ESC [ ... m`)
  is kept. Every piece of a line cut at a carriage return gets its own prefix, and on a
  terminal whatever is written after a progress frame first erases the frame's line, so no
  rest of one rank's frame can read as part of another's line.
- Progress frames (a line ended by a bare carriage return: tqdm, pip, rich) are redrawn in
  place on a terminal. On a console that is not a terminal they become plain lines: a
  worker's first frame, then at most one every FRAME_EVERY_S, each ended by a newline;
  blank frames are dropped. The line that ends the bar (with a newline) shows as any line.
- Without --log_dir, the console keeps each worker's last TAIL_LINES lines of the attempt;
  when the summary reports lines not shown, those are written to a new temporary folder
  (`dslaunch-run-*` in $TMPDIR, left for the user) and the summary names the real file.
- torch's own `[rankN]: ` excepthook prefix is dropped on the console where ours says the same.
- After the launcher passed a Ctrl-C (SIGINT) on to the workers, a traceback that ends in
  `KeyboardInterrupt` is the workers doing as asked: it is not shown (the log files keep it),
  so a stopped job reads as the launcher's own lines, not one traceback per rank.
- When the console reader is too slow and CONSOLE_BUFFER bytes are waiting, further
  worker lines are dropped from the console (never from the log files) and counted; the
  count is reported at the end. The launcher's own messages are never dropped.
"""
from __future__ import annotations

import collections
import os
import re
import secrets
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.failure import Failure
from dslaunch.launcher.private_files import open_append, open_shared_dir
from dslaunch.launcher.writer import BoundedWriter

STDOUT, STDERR = "stdout", "stderr"
DELAY_S = 0.25
TRACEBACK_S = 2.0
CONSOLE_BUFFER = 8 << 20
FRAME_EVERY_S = 10.0  # a non-terminal console shows one progress frame per worker and stream this often
TAIL_LINES = 200  # per worker, kept for the summary when there is no --log_dir
LOG_BUFFER = 32 << 20
_COLOURS = (b"\x1b[36m", b"\x1b[33m", b"\x1b[35m", b"\x1b[32m", b"\x1b[34m", b"\x1b[91m", b"\x1b[96m", b"\x1b[93m")
_RESET = b"\x1b[0m"
_TRACEBACK = b"Traceback (most recent call last):"
_TORCH_PREFIX = re.compile(rb"^\[rank(\d+)\]: ?")
_NEEDS_ESCAPE = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # a fast test; 0x80-0x9f may be UTF-8
# SGR kept; C0 (not tab), DEL, C1, and bytes that are not UTF-8 in C1's range (8-bit CSI is 0x9b)
_CONTROL = re.compile("(\x1b\\[[0-9;:]*m)|([\x00-\x08\x0a-\x1f\x7f-\x9f\udc80-\udc9f])")
_ENDINGS = (b"\r\n", b"\n", b"\r")


def escape_controls(data: bytes) -> bytes:
    """A worker's line as the console shows it: its line ending kept, colour sequences
    kept, every other control character written out as `\\xNN`."""
    ending = next((e for e in _ENDINGS if data.endswith(e)), b"")
    body = data[: len(data) - len(ending)]
    if not _NEEDS_ESCAPE.search(body):
        return data
    text = body.decode("utf-8", "surrogateescape")

    def one(m: "re.Match[str]") -> str:
        if m.group(1):
            return m.group(1)
        c = ord(m.group(2))
        return f"\\x{c - 0xdc00 if c >= 0xdc00 else c:02x}"

    return _CONTROL.sub(one, text).encode("utf-8", "surrogateescape") + ending


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


def check_log_dir(path: str, ranks: Sequence[int] = ()) -> None:
    """Before anything starts: create --log_dir, prove it writable and writable by no other
    user, and open each rank's log file as the job will (refused if it is a link, a FIFO,
    another user's file or a hard link)."""
    fd = open_shared_dir(path, "--log_dir")
    probe = f".dslaunch-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd))
            os.unlink(probe, dir_fd=fd)
        except OSError as e:
            raise LaunchConfigError(f"--log_dir {path}: cannot write there ({e.strerror or e})") from None
        for r in ranks:
            os.close(open_append(fd, f"rank_{r}.log", str(Path(path) / f"rank_{r}.log"), "log file"))
    finally:
        os.close(fd)


def _is_tty(stream: BinaryIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _wants_colour(stream: BinaryIO) -> bool:
    return _is_tty(stream) and "NO_COLOR" not in os.environ


class LogDirSink:
    """One file per rank, `rank_<N>.log`, both streams in arrival order, appended across runs.

    The folder is opened once and checked (no other user may write it), and each file is
    opened relative to it without following a link and checked to be a plain file of ours
    (private_files.py): a `rank_0.log -> /etc/passwd` planted there gets nothing, and the
    job does not start."""

    def __init__(self, log_dir: str, ranks: Sequence[int], header: str):
        self.dir = Path(log_dir)
        self._files: Dict[int, Tuple[BinaryIO, BoundedWriter]] = {}
        dir_fd = open_shared_dir(log_dir, "--log_dir")
        try:
            for r in ranks:
                fd = open_append(dir_fd, f"rank_{r}.log", str(self.path(r)), "log file")
                f = os.fdopen(fd, "ab", buffering=0)
                w = BoundedWriter(f, LOG_BUFFER, name=f"dslaunch-log-{r}", flush=False)
                w.write(f"=== {header} ===\n".encode(), force=True)
                self._files[r] = (f, w)
        except LaunchConfigError:
            self.close()
            raise
        finally:
            os.close(dir_fd)

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
class _Held:
    due: float
    line: OutputLine
    size: int


@dataclass(frozen=True)
class AttemptSummary:
    """What the summary after a failed attempt says, besides the failure itself."""

    failure: Failure
    ended: Mapping[str, str]  # label -> "stopped" | "failed" | "succeeded" for the other workers
    total: int


class JobOutput:
    """The head's output for a whole job (all attempts). Thread-safe; never blocks the caller."""

    def __init__(self, out: BinaryIO, err: BinaryIO, log_dir: Optional[str] = None, run_id: str = "",
                 delay_s: float = DELAY_S, traceback_s: float = TRACEBACK_S, capacity: int = CONSOLE_BUFFER,
                 tail_root: Optional[str] = None):
        self._streams = {STDOUT: (out, _wants_colour(out)), STDERR: (err, _wants_colour(err))}
        self._tty = {STDOUT: _is_tty(out), STDERR: _is_tty(err)}
        self._frame_open = False  # the terminal's cursor sits at the start of a progress frame's line
        self._log_dir = log_dir
        self._run_id = run_id
        self._delay_s = delay_s
        self._traceback_s = traceback_s
        self._capacity = capacity
        self._logs: Optional[LogDirSink] = None
        self._events: Deque[tuple] = collections.deque()
        self._pending = 0  # bytes of worker lines taken and not yet shown or hidden
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0  # worker lines the console could not take
        # console-thread state; failure, hidden counts and stderr_shown are per attempt
        self._failure: Optional[Failure] = None
        self._hidden: Dict[str, int] = {}
        self._ranks: Dict[str, int] = {}
        self._stderr_shown: set = set()
        self._held: Deque[_Held] = collections.deque()  # stderr lines, for delay_s, in arrival order
        self._tracebacks: Dict[str, Tuple[float, List[_Held]]] = {}  # label -> (due, a traceback block)
        self._gone: set = set()  # streams whose reader went away
        self._frames: Dict[Tuple[str, str], float] = {}  # (label, stream) -> when its last frame was shown
        self._tails: Dict[str, Deque[bytes]] = {}  # label -> its last lines (no --log_dir only)
        self._tail_dir: Optional[Path] = None  # made when a summary first needs it
        self._tail_root = tail_root  # where that folder is made ($TMPDIR when None)
        self._restart = 0
        self._stop_signal: Optional[int] = None  # the signal the launcher passed on to stop the job
        self._thread = threading.Thread(target=self._loop, name="dslaunch-console", daemon=True)
        self._thread.start()

    # -- producers (any thread) ------------------------------------------------------------

    def start_attempt(self, restart: int, ranks: Sequence[int]) -> None:
        self._restart = restart
        if self._log_dir:
            if self._logs is not None:
                self._logs.close()
            self._logs = LogDirSink(self._log_dir, ranks, f"dslaunch run {self._run_id} restart {restart}")
        self._put(("attempt",), force=True)

    def line(self, line: OutputLine) -> None:
        logs = self._logs
        if logs is not None:
            logs.write(line)
        self._put(("line", line, time.monotonic()), size=len(line.data))

    def failed(self, failure: Failure) -> None:
        self._put(("failed", failure, time.monotonic()), force=True)

    def stopping(self, signum: int) -> None:
        """The launcher is passing `signum` on to every worker. Safe in a signal handler: one
        assignment, no lock (the handler may interrupt this object's own code)."""
        if self._stop_signal is None:
            self._stop_signal = signum

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
                    timeout = self._next_due()
                    if timeout is not None and timeout <= 0:
                        break
                    self._cond.wait(timeout)
                batch = list(self._events)
                self._events.clear()
                closing = self._closed and not batch
            for event, size in batch:
                getattr(self, "_on_" + event[0])(*event[1:], **({"size": size} if event[0] == "line" else {}))
            self._release_due(time.monotonic())
            if closing:
                self._flush()
                if self.dropped:
                    where = f"every line is in {self._log_dir}" if self._log_dir else "rerun with --log_dir to keep every line"
                    self._say_now(f"{self.dropped} worker line(s) were not shown: the console did not keep up ({where})")
                return

    def _next_due(self) -> Optional[float]:
        dues = [due for due, _ in self._tracebacks.values()]
        if self._held:
            dues.append(self._held[0].due)
        return min(dues) - time.monotonic() if dues else None

    def _on_attempt(self) -> None:
        self._flush()
        self._failure = None
        self._hidden.clear()
        self._stderr_shown.clear()
        self._tails.clear()

    def _on_line(self, line: OutputLine, arrived: float, size: int) -> None:
        self._ranks[line.label] = line.rank
        if not self._log_dir:
            tail = self._tails.get(line.label)
            if tail is None:
                tail = self._tails[line.label] = collections.deque(maxlen=TAIL_LINES)
            tail.append(line.data)
        held = _Held(arrived + self._delay_s, line, size)
        f = self._failure
        if f is not None and line.label != f.label:
            self._hide(held)
        elif line.stream == STDERR and line.label in self._tracebacks:
            self._tracebacks[line.label][1].append(held)
        elif line.stream == STDERR and f is None and self._strip(line).startswith(_TRACEBACK):
            self._tracebacks[line.label] = (arrived + self._traceback_s, [held])
        elif line.stream == STDERR:
            self._held.append(held)
        else:
            self._show(held)

    def _on_failed(self, failure: Failure, at: float) -> None:
        if self._failure is not None:
            return
        # stderr lines held longer than delay_s when the failure happened were due before it
        # (the console thread may just not have run since): shown, not follow-ons. A pending
        # traceback block of another worker stays a follow-on, as before.
        while self._held and self._held[0].due <= at:
            self._show(self._held.popleft())
        self._failure = failure
        # what the others wrote in the last instant is a follow-on of this failure: hidden
        keep = collections.deque()
        for held in self._held:
            if held.line.label == failure.label:
                keep.append(held)
            else:
                self._hide(held)
        self._held = keep
        self._flush()

    def _on_exited(self, label: str) -> None:
        self._release_traceback(label)

    def _on_say(self, text: str) -> None:
        self._flush()
        self._say_now(text)

    def _on_summary(self, s: AttemptSummary) -> None:
        self._flush()
        f = s.failure
        lines = [f.describe()]
        if f.stderr_tail and f.label not in self._stderr_shown:
            lines.append(f"last {len(f.stderr_tail)} line(s) of {f.label}'s stderr:")
            lines += ["  | " + escape_controls(t.encode("utf-8", "surrogateescape")).decode("utf-8", "replace")
                      for t in f.stderr_tail]
        for label, state in s.ended.items():
            hidden = self._hidden.get(label, 0)
            if not hidden:
                continue
            how = f"stopped after {f.label} failed" if state == "stopped" else f"also {state}"
            lines.append(f"{label}: {how}; {hidden} line(s) not shown{self._where_kept(label, hidden)}")
        stopped = sum(1 for state in s.ended.values() if state == "stopped")
        if stopped:
            lines.append(f"stopped the other {stopped} of {s.total} worker(s)")
        self._say_now("\n".join(lines))

    def _where_kept(self, label: str, hidden: int) -> str:
        """Where the summary can truly say a worker's hidden lines are: its --log_dir file,
        or its last lines written now into a temporary folder; nothing if that fails."""
        rank = self._ranks.get(label)
        if self._log_dir:
            return f", all in {Path(self._log_dir) / f'rank_{rank}.log'}" if rank is not None else ""
        tail = self._tails.get(label)
        if not tail:
            return ""
        try:
            if self._tail_dir is None:
                self._tail_dir = Path(tempfile.mkdtemp(prefix="dslaunch-run-", dir=self._tail_root))
            restart = f".restart_{self._restart}" if self._restart else ""
            path = self._tail_dir / f"rank_{rank}{restart}.log"
            path.write_bytes(b"".join(tail))
        except OSError as e:
            return f" (could not keep them: {e.strerror or e}; --log_dir keeps every line)"
        kept = "all" if len(tail) >= hidden else f"its last {len(tail)} lines"
        return f", {kept} in {path}"

    def _release_due(self, now: float) -> None:
        for label in [k for k, (due, _) in self._tracebacks.items() if due <= now]:
            self._release_traceback(label)
        while self._held and self._held[0].due <= now:
            self._show(self._held.popleft())

    def _release_traceback(self, label: str) -> None:
        entry = self._tracebacks.pop(label, None)
        if entry is None:
            return
        f = self._failure
        interrupted = self._stop_signal == signal.SIGINT and self._ends_in_keyboard_interrupt(entry[1])
        for held in entry[1]:
            if interrupted or (f is not None and label != f.label):
                self._hide(held)
            else:
                self._show(held)

    def _ends_in_keyboard_interrupt(self, block: List[_Held]) -> bool:
        """A traceback whose exception (its last unindented line) is a bare KeyboardInterrupt."""
        for held in reversed(block):
            text = self._strip(held.line).rstrip(b"\r\n")
            if text and not text[:1].isspace():
                return text == b"KeyboardInterrupt"
        return False

    def _flush(self) -> None:
        """Everything held goes out now (before a launcher message, at the end of an attempt)."""
        for label in list(self._tracebacks):
            self._release_traceback(label)
        while self._held:
            self._show(self._held.popleft())

    def _hide(self, held: _Held) -> None:
        self._hidden[held.line.label] = self._hidden.get(held.line.label, 0) + 1
        self._done(held.size)

    def _done(self, size: int) -> None:
        with self._cond:
            self._pending -= size

    def _strip(self, line: OutputLine) -> bytes:
        m = _TORCH_PREFIX.match(line.data)
        if m and int(m.group(1)) == line.rank:
            return line.data[m.end():]
        return line.data

    def _show(self, held: _Held) -> None:
        line = held.line
        self._done(held.size)
        target, colour = self._streams[line.stream]
        data = escape_controls(self._strip(line))
        if not self._tty[line.stream] and data.endswith(b"\r"):  # a progress frame, on a console that is no terminal
            data = self._plain_frame(line, data, held.due)
            if data is None:
                return
        if line.stream == STDERR:
            self._stderr_shown.add(line.label)
        prefix = f"[{line.label}] ".encode()
        if colour:
            prefix = _COLOURS[line.rank % len(_COLOURS)] + prefix[:-1] + _RESET + b" "
        self._write(target, prefix + data)

    def _plain_frame(self, line: OutputLine, data: bytes, at: float) -> Optional[bytes]:
        """A progress frame as a plain line, or None when it is blank or too soon after the last."""
        text = data.rstrip(b"\r")
        if not text.strip():
            return None
        key = (line.label, line.stream)
        last = self._frames.get(key)
        if last is not None and at - last < FRAME_EVERY_S:
            return None
        self._frames[key] = at
        return text + b"\n"

    def _say_now(self, text: str) -> None:
        data = "".join(f"dslaunch: {t}\n" for t in text.splitlines()).encode()
        self._write(self._streams[STDERR][0], data)

    def _write(self, target: BinaryIO, data: bytes) -> None:
        if id(target) in self._gone:
            return
        if _is_tty(target):
            if self._frame_open:
                data = b"\x1b[2K" + data  # erase the frame's line first
            self._frame_open = data.endswith(b"\r")
        try:
            target.write(data)
            target.flush()
        except (BrokenPipeError, ValueError, OSError):
            # `dslaunch ... | head`: the reader left; keep supervising, stop printing there
            self._gone.add(id(target))
