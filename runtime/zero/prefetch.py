"""Stage-3 gathers ahead of use: the recorded module order and the all-gathers in flight.

The first forward records which hooked modules run, in order (`ModuleTrace`). Later forwards
that follow the record let `Prefetcher` start the all-gathers of the next modules' parameters
asynchronously, up to stage3_prefetch_bucket_size elements gathered ahead of use, while the
current module computes; backward does the same walking the record in reverse. A module's
pre-hook first lands (waits for and unpacks) any in-flight gather holding its parameters and
gathers what is still missing itself.

Every rank records the same order and so issues the same collectives in the same order (the
opt-in divergence check says which module differs when a rank does not). Gathers that were
not needed after all (a forward that ended early, a module that took no part in backward) are
waited for and dropped, leaving their parameters at rest, before the shards can change.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from .params import PendingGather, is_partitioned, is_present, start_gather

# Prefetched modules smaller than this many elements are merged into one collective with the
# modules after them: a gloo all-gather costs ~0.1 ms before any byte moves.
MIN_COLLECTIVE = 1 << 18


class ModuleTrace:
    """The recorded forward order of hooked modules, with what the release and reuse rules
    ask of it precomputed (pure bookkeeping, no communication)."""

    def __init__(self, modules: Sequence[torch.nn.Module], own: Callable[[torch.nn.Module], List],
                 gathered_numel: Callable[[torch.nn.Module], int]):
        self.modules = list(modules)
        n = len(self.modules)
        self.prefix = [0]  # elements gathered by entries [0, i)
        for m in self.modules:
            self.prefix.append(self.prefix[-1] + gathered_numel(m))
        self.next_use: List[Optional[int]] = [None] * n  # the entry's next occurrence of the same module
        seen: Dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            self.next_use[i] = seen.get(id(self.modules[i]))
            seen[id(self.modules[i])] = i
        self.last_use: Dict[int, int] = {}  # id(param) -> last entry that gathers it
        for i, m in enumerate(self.modules):
            for p in own(m):
                self.last_use[id(p)] = i

    def __len__(self) -> int:
        return len(self.modules)

    def reused_within(self, i: int, max_reuse: int, grad: bool) -> bool:
        """Whether entry i's parameters are needed again within max_reuse elements of other
        gathers: later in this forward, or in backward (after the rest of the forward and
        the backward of the modules after it, about twice their size)."""
        j = self.next_use[i]
        if j is not None:
            return self.prefix[j] - self.prefix[i + 1] < max_reuse
        return grad and 2 * (self.prefix[-1] - self.prefix[i + 1]) < max_reuse

    def used_after(self, p, i: int) -> bool:
        return self.last_use.get(id(p), -1) > i


class Prefetcher:
    """The asynchronous all-gathers in flight and the elements gathered ahead of use."""

    def __init__(self, own: Callable[[torch.nn.Module], List], name: Callable[[torch.nn.Module], str],
                 check=None):
        self.own, self.name, self.check = own, name, check
        self.inflight: Dict[int, PendingGather] = {}  # id(param) -> the gather carrying it
        self.unused: Dict[int, int] = {}  # id(param) -> numel, prefetched and not yet asked for
        self.ahead = 0  # forward: the next trace entry not yet considered
        self.behind = -1  # backward: the next trace entry (walking down) not yet considered
        self.done_backward: set = set()  # modules whose backward gather has run this backward

    def inflight_numel(self) -> int:
        return sum(p.numel for p in {id(p): p for p in self.inflight.values()}.values())

    def land(self, params) -> None:
        """Wait for the in-flight gathers that carry any of `params`; their parameters become whole."""
        if not (self.inflight or self.unused):
            return
        for p in params:
            pend = self.inflight.get(id(p))
            if pend is not None:
                pend.finish()
                for q in pend.params:
                    self.inflight.pop(id(q), None)
            self.unused.pop(id(p), None)

    def drop_all(self) -> None:
        """Wait for every gather still in flight and leave its parameters at rest."""
        for pend in {id(p): p for p in self.inflight.values()}.values():
            pend.discard()
        self.inflight.clear()
        self.unused.clear()

    def start_forward(self) -> None:
        self.drop_all()
        self.ahead = 0

    def start_backward(self, trace_len: int) -> None:
        self.behind = trace_len - 1
        self.done_backward.clear()

    def _missing(self, m, taken: set) -> List[torch.nn.Parameter]:
        return [p for p in self.own(m) if is_partitioned(p) and not p._zero.persistent and not is_present(p)
                and id(p) not in self.inflight and id(p) not in taken]

    def _issue(self, params: List[torch.nn.Parameter], what: str) -> None:
        pend = start_gather(params, check=self.check, what=f"prefetch {what}", async_op=True, training=True)
        if pend is not None:
            for p in pend.params:
                self.inflight[id(p)] = pend
                self.unused[id(p)] = p._zero.numel

    def run(self, trace: ModuleTrace, room: int, forward: bool, start: int) -> None:
        """Start gathers for the trace entries after `start` (forward) or before it (backward),
        in that order, while they fit in `room` elements: one collective per module, small
        modules merged with the ones after them."""
        room -= sum(self.unused.values())
        step = 1 if forward else -1
        i = max(self.ahead, start + 1) if forward else min(self.behind, start - 1)
        batch: List[torch.nn.Parameter] = []
        taken: set = set()
        first = None
        while 0 <= i < len(trace):
            m = trace.modules[i]
            if not forward and id(m) in self.done_backward:
                i += step
                continue
            extra = self._missing(m, taken)
            size = sum(p._zero.numel for p in extra)
            if size > room:
                break
            room -= size
            batch += extra
            taken.update(id(p) for p in extra)
            if first is None:
                first = m
            if sum(p._zero.numel for p in batch) >= MIN_COLLECTIVE:
                self._issue(batch, f"{self.name(first)}..{self.name(m)}")
                batch, taken, first = [], set(), None
            i += step
        if batch:
            self._issue(batch, f"{self.name(first)}..")
        if forward:
            self.ahead = i
        else:
            self.behind = i
