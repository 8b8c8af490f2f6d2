"""Shard arithmetic for ZeRO: pure functions, no torch.distributed.

Two layouts are used:

* Flat layout (stages 1 and 2): every trainable parameter of a group is laid end to end
  in one virtual 1-D buffer, padded to a multiple of twice the world size (DeepSpeed's); rank r owns the
  contiguous range [r*P, (r+1)*P). A parameter may straddle two ranks.
* Per-parameter layout (stage 3): each parameter is padded to a multiple of the world
  size on its own and rank r keeps the r-th equal chunk, so a module's parameters can be
  gathered independently of the others.

Both describe what a rank holds as `Piece`s: (parameter name, [start, end) in that
parameter's flattened elements). Checkpoints store pieces, which is what lets a
checkpoint written at one world size and stage be read at another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..core.reduction import plan_buckets  # noqa: F401  (the bucketing every strategy shares lives in core)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_size(numel: int, world_size: int) -> int:
    """Smallest multiple of world_size that holds numel elements (0 stays 0)."""
    return ceil_div(numel, world_size) * world_size


@dataclass(frozen=True)
class Piece:
    """Elements [start, end) of parameter `name` (flattened), stored at `offset` in the
    owner's local partition buffer."""

    name: str
    start: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Slot:
    name: str
    shape: Tuple[int, ...]
    numel: int
    offset: int  # where the parameter starts in the flat buffer


@dataclass(frozen=True)
class FlatLayout:
    slots: Tuple[Slot, ...]
    world_size: int

    @staticmethod
    def build(named_shapes: Sequence[Tuple[str, Tuple[int, ...]]], world_size: int) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots, offset = [], 0
        for name, shape in named_shapes:
            numel = 1
            for d in shape:
                numel *= int(d)
            slots.append(Slot(name, tuple(int(d) for d in shape), numel, offset))
            offset += numel
        return FlatLayout(tuple(slots), world_size)

    @property
    def total(self) -> int:
        return self.slots[-1].offset + self.slots[-1].numel if self.slots else 0

    @property
    def padded_total(self) -> int:
        # DeepSpeed's stage 1/2 alignment (2 x world size), so rank r's partition is exactly
        # DeepSpeed's partition r and checkpoint shards are interchangeable with its files;
        # never zero, so every rank has a (possibly all-padding) partition to step
        align = 2 * self.world_size
        return max(padded_size(self.total, align), align)

    @property
    def partition_size(self) -> int:
        return self.padded_total // self.world_size

    def partition_range(self, rank: int) -> Tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        p = self.partition_size
        return rank * p, (rank + 1) * p

    def pieces(self, rank: int) -> List[Piece]:
        """The parameter pieces rank owns, in flat order; offsets are into its partition."""
        lo, hi = self.partition_range(rank)
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(Piece(s.name, a - s.offset, b - s.offset, a - lo))
        return out

    def owner_ranks(self, name: str) -> List[int]:
        s = next(x for x in self.slots if x.name == name)
        if s.numel == 0:
            return []
        p = self.partition_size
        return list(range(s.offset // p, (s.offset + s.numel - 1) // p + 1))


def param_shard(numel: int, world_size: int, rank: int) -> Piece:
    """Stage 3: the chunk of one parameter rank keeps (end clipped to the real size;
    the shard buffer itself is always padded_size/world_size long)."""
    chunk = padded_size(numel, world_size) // world_size
    start = min(rank * chunk, numel)
    end = min(start + chunk, numel)
    return Piece("", start, end, 0)


def intersect(pieces: Sequence[Piece], name: str, start: int, end: int) -> List[Tuple[Piece, int, int]]:
    """For loading: which stored pieces of `name` cover [start, end), and the overlap
    [a, b) of each, in parameter coordinates."""
    out = []
    for p in pieces:
        if p.name != name:
            continue
        a, b = max(p.start, start), min(p.end, end)
        if a < b:
            out.append((p, a, b))
    return out


def coverage_gaps(spans: Sequence[Tuple[int, int]], numel: int) -> List[Tuple[int, int]]:
    """Ranges of [0, numel) that no span covers (used to refuse an incomplete checkpoint)."""
    gaps, pos = [], 0
    for a, b in sorted(spans):
        if a > pos:
            gaps.append((pos, a))
        pos = max(pos, b)
    if pos < numel:
        gaps.append((pos, numel))
    return gaps


def pieces_to_dict(pieces: Sequence[Piece]) -> List[Dict]:
    return [{"name": p.name, "start": p.start, "end": p.end, "offset": p.offset} for p in pieces]


def pieces_from_dict(rows: Sequence[Dict]) -> List[Piece]:
    return [Piece(r["name"], int(r["start"]), int(r["end"]), int(r["offset"])) for r in rows]
