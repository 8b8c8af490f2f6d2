"""`deepspeed.utils.pin_memory_tracker`: a running total of host memory pinned through the
accelerator (`get_accelerator().pin_memory`), as DeepSpeed keeps one.

Pinned (page-locked) memory cannot be swapped and counts against the memlock limit, so a
host that runs out of memory far from the allocation that used it up is easier to diagnose
with the total in the log: each pin is logged at debug level, and every time the total
crosses 32 GiB, 64 GiB, 128 GiB, ... one line is logged at info level. On the CPU
accelerator nothing is pinned, so nothing is counted.
"""
from __future__ import annotations

import logging

_GIB = 1024 ** 3
_FIRST_CHECKPOINT = 32 * _GIB

log = logging.getLogger("dslaunch.runtime")


def _fmt_bytes(num_bytes: int) -> str:
    """A byte count in DeepSpeed's log format: "512 B", "2.0 KB", "1.00 MB", "1.500 GB"."""
    for unit, size, digits in (("GB", _GIB, 3), ("MB", 1024 ** 2, 2), ("KB", 1024, 1)):
        if num_bytes >= size:
            return f"{num_bytes / size:.{digits}f} {unit}"
    return f"{num_bytes} B"


class _PinnedMemoryTracker:
    """The process-wide total (`_bytes`), the number of pins (`_calls`) and the next total at
    which an info line is logged (`_next_checkpoint`, doubling from 32 GiB)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes = 0
        self._calls = 0
        self._next_checkpoint = _FIRST_CHECKPOINT

    def track(self, num_bytes: int) -> None:
        self._bytes += int(num_bytes)
        self._calls += 1
        log.debug(f"pin_memory: +{_fmt_bytes(num_bytes)} (pin #{self._calls}, {_fmt_bytes(self._bytes)} in all)")
        while self._bytes >= self._next_checkpoint:  # one call may cross several thresholds: a line each
            log.info(f"[pinned-memory checkpoint] crossed {_fmt_bytes(self._next_checkpoint)}: "
                     f"{_fmt_bytes(self._bytes)} pinned in {self._calls} allocations")
            self._next_checkpoint *= 2

    def log_summary(self, tag: str = "") -> None:
        label = f"[pinned-memory {tag}]" if tag else "[pinned-memory]"
        log.info(f"{label} {_fmt_bytes(self._bytes)} pinned in {self._calls} allocations")


_tracker = _PinnedMemoryTracker()


def track_pinned_memory(num_bytes: int) -> None:
    """Count num_bytes just pinned."""
    _tracker.track(num_bytes)


def pinned_memory_summary(tag: str = "") -> None:
    """Log the total pinned so far (tag names the moment, e.g. "after engine init")."""
    _tracker.log_summary(tag)


__all__ = ["track_pinned_memory", "pinned_memory_summary"]
