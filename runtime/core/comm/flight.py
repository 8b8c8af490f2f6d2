"""The flight record: each rank's last N collectives, and how to name a mismatch.

Every collective that goes through dslaunch.runtime.comm gets an `Entry`: its op, its
group, its payload in bytes, the caller's label ("stage3 gather blocks.2 (forward)") and a
sequence number counted per group, so the k-th collective on a group is #k on every
member that is in step. Point-to-point calls are counted per (group, peer) instead.

When something hangs, each rank condenses its record into a `RankReport` (what it is in,
what it last finished, where its main thread is) and `explain` turns the reports of all
ranks into one line such as

    rank 1 is in all_gather #57 on world (stage3 gather blocks.2), rank 0 in reduce_scatter #58 on world

Pure logic, no torch.distributed: the watchdog (watchdog.py) moves the reports between ranks.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional

DEFAULT_DEPTH = 64  # entries kept per rank


@dataclass
class Entry:
    seq: int
    op: str
    group: str  # "world", or the group's name ("ranks 0,2" unless it was given one)
    nbytes: int
    label: str
    started: float  # time.monotonic()
    ended: Optional[float] = None
    error: Optional[str] = None
    work: Any = field(default=None, repr=False, compare=False)  # an async op's handle, until done

    def finished(self) -> bool:
        if self.ended is None and self.work is not None:
            try:
                done = self.work.is_completed()
            except Exception:  # its group was destroyed: nothing is waiting any more
                done = True
            if done:
                self.ended, self.work = time.monotonic(), None
        return self.ended is not None

    def describe(self) -> str:
        text = f"{self.op} #{self.seq} on {self.group}"
        return f"{text} ({self.label})" if self.label else text

    def as_dict(self, now: float) -> Dict[str, Any]:
        d = {"seq": self.seq, "op": self.op, "group": self.group, "nbytes": self.nbytes, "label": self.label,
             "error": self.error, "age_s": round(now - self.started, 3)}
        d["state"] = "failed" if self.error else ("done" if self.finished() else "in flight")
        if self.ended is not None:
            d["took_s"] = round(self.ended - self.started, 4)
        return d


class FlightRecorder:
    """A ring of the last `depth` entries; safe to read from the watchdog thread."""

    def __init__(self, depth: int = DEFAULT_DEPTH):
        self._entries: Deque[Entry] = deque(maxlen=depth)
        self._seq: Dict[Any, int] = {}
        self._lock = threading.Lock()
        # entries holding an async handle: a torch Work keeps the collective's tensors alive, so
        # each new collective lets go of the handles that have completed since
        self._holding: List[Entry] = []

    def begin(self, op: str, group_key: Any, group: str, nbytes: int, label: str = "") -> Entry:
        self.release_finished()
        with self._lock:
            seq = self._seq.get(group_key, 0) + 1
            self._seq[group_key] = seq
            e = Entry(seq, op, group, int(nbytes), label or "", time.monotonic())
            self._entries.append(e)
        return e

    def release_finished(self) -> None:
        """Let go of the completed handles now rather than at the next collective."""
        if self._holding:
            self._holding = [e for e in self._holding if not e.finished()]

    def end(self, e: Entry, work: Any = None) -> None:
        """Done now, or (async) once `work` completes."""
        if work is not None:
            e.work = work
            self._holding.append(e)
        else:
            e.ended = time.monotonic()

    @staticmethod
    def fail(e: Entry, exc: BaseException) -> None:
        e.ended, e.error = time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]

    def entries(self) -> List[Entry]:
        with self._lock:
            return list(self._entries)

    def oldest_pending(self) -> Optional[Entry]:
        for e in self.entries():
            if not e.finished():
                return e
        return None

    def last_finished(self) -> Optional[Entry]:
        for e in reversed(self.entries()):
            if e.finished():
                return e
        return None

    def forget_handles(self) -> None:
        """Drop the async handles (at exit: a Work keeps its process group's threads alive)."""
        for e in self.entries():
            if e.work is not None:
                e.finished()
                e.work = None

    def clear(self) -> None:
        with self._lock:
            self._holding.clear()
            self._entries.clear()
            self._seq.clear()


@dataclass
class RankReport:
    """What one rank says about itself when a hang is investigated."""

    rank: int
    current: Optional[Dict[str, Any]]  # the oldest unfinished entry (as_dict), if any
    last: Optional[Dict[str, Any]]  # the newest finished one
    where: str  # the main thread's innermost frame, "file:line in function"

    @classmethod
    def of(cls, rank: int, rec: FlightRecorder, where: str) -> "RankReport":
        now = time.monotonic()
        cur, last = rec.oldest_pending(), rec.last_finished()
        return cls(rank, cur.as_dict(now) if cur else None, last.as_dict(now) if last else None, where)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "RankReport":
        return cls(d["rank"], d.get("current"), d.get("last"), d.get("where", "?"))


def _describe(d: Dict[str, Any]) -> str:
    text = f"{d['op']} #{d['seq']} on {d['group']}"
    return f"{text} ({d['label']})" if d.get("label") else text


def _state(r: RankReport, first: bool) -> str:
    """'is in all_gather #57 on world (label)' or 'is not in a collective (...)'."""
    verb = "is in" if first else "in"
    if r.current is not None:
        return f"{verb} {_describe(r.current)} for {r.current['age_s']:.1f} s"
    last = f"last {_describe(r.last)}, {r.last['age_s']:.1f} s ago" if r.last else "none yet"
    return f"{'is ' if first else ''}not in a collective ({last}; main thread at {r.where})"


def explain(reports: Dict[int, RankReport], world_size: int) -> str:
    """One line naming where each rank is, the disagreeing ones first."""
    if not reports:
        return "no rank could be reached"
    # ranks that are in the same collective as the most common one go last: they are waiting
    keys: Dict[int, Any] = {}
    for r, rep in reports.items():
        c = rep.current
        keys[r] = (c["group"], c["seq"], c["op"]) if c else None
    counts: Dict[Any, int] = {}
    for k in keys.values():
        counts[k] = counts.get(k, 0) + 1
    order = sorted(reports, key=lambda r: (counts[keys[r]], keys[r] is not None, r))
    parts = []
    for i, r in enumerate(order):
        parts.append(f"rank {r} {_state(reports[r], i == 0)}")
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        parts.append(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer "
                     "(dead, or blocked outside Python)")
    distinct = {k for k in keys.values() if k is not None}
    head = "ranks disagree: " if len(distinct) > 1 or (distinct and None in keys.values()) else ""
    return head + ", ".join(parts)
