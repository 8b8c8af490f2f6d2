"""Where worker lines go: the console with a `[rank N]` prefix, and per-rank log files.

A sink is called once per whole line (see supervisor.Sink). Colours only when the
target stream is a terminal and NO_COLOR is unset, so logs and pipes stay plain.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Dict, Optional, Sequence

from dslaunch.launcher.supervisor import STDERR, Sink, WorkerSpec

_COLOURS = (b"\x1b[36m", b"\x1b[33m", b"\x1b[35m", b"\x1b[32m", b"\x1b[34m", b"\x1b[91m", b"\x1b[96m", b"\x1b[93m")
_RESET = b"\x1b[0m"


def _wants_colour(stream: BinaryIO) -> bool:
    try:
        return stream.isatty() and "NO_COLOR" not in os.environ
    except (AttributeError, ValueError):
        return False


class ConsoleSink:
    """`[rank 3] line` to our stdout or stderr, matching the stream the worker wrote to."""

    def __init__(self, out: BinaryIO, err: BinaryIO):
        self._streams = {"stdout": (out, _wants_colour(out)), STDERR: (err, _wants_colour(err))}

    def __call__(self, spec: WorkerSpec, stream: str, line: bytes) -> None:
        target, colour = self._streams[stream]
        prefix = f"[{spec.label}] ".encode()
        if colour:
            prefix = _COLOURS[spec.rank % len(_COLOURS)] + prefix[:-1] + _RESET + b" "
        try:
            target.write(prefix + line)
            target.flush()
        except BrokenPipeError:
            # `dslaunch ... | head`: the reader left; keep supervising, stop printing.
            pass


class LogDirSink:
    """One file per rank, `rank_<N>.log`, both streams in arrival order; appended across runs."""

    def __init__(self, log_dir: str, ranks: Sequence[int], header: str):
        self._dir = Path(log_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        self._files: Dict[int, BinaryIO] = {}
        for r in ranks:
            f = open(self._dir / f"rank_{r}.log", "ab", buffering=0)
            f.write(f"=== {header} ===\n".encode())
            self._files[r] = f

    def __call__(self, spec: WorkerSpec, stream: str, line: bytes) -> None:
        f = self._files.get(spec.rank)
        if f is not None:
            f.write(line)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def tee(*sinks: Optional[Sink]) -> Sink:
    active = [s for s in sinks if s is not None]

    def fan_out(spec: WorkerSpec, stream: str, line: bytes) -> None:
        for s in active:
            s(spec, stream, line)

    return fan_out
