"""Cutting a list of layers into contiguous pipeline stages: pure functions.

A partition is a list `parts` of num_stages + 1 boundaries: stage s owns layers
[parts[s], parts[s+1]). The three methods of `PipelineModule(partition_method=...)`:

    "uniform"      the same number of layers per stage (the first stages take one more
                   when it does not divide)
    "parameters"   balance the trainable parameter count of each stage
    "type:REGEX"   balance the number of layers whose class (or function) name matches
                   REGEX (case-insensitive), e.g. "type:Block" for transformer blocks; every
                   stage must get at least one of them

Balancing follows DeepSpeed's linear-partition rule (choose cuts that make the heaviest
and the lightest stage as close as possible, later cuts winning ties), so a model is
split at the same layers as under DeepSpeed (checked against a fixture made by DeepSpeed).
"""
from __future__ import annotations

import re
from typing import Callable, List, Sequence


class PartitionError(ValueError):
    pass


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    if num_parts < 1:
        raise PartitionError(f"num_parts must be >= 1, got {num_parts}")
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    # the first `extra` parts get one more item
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> List[int]:
    """Contiguous parts whose weight sums are as even as the DP below finds: for each
    prefix of i items cut into j parts it keeps the cut that minimises (heaviest part -
    lightest part), preferring the later cut on ties."""
    n, m = len(weights), num_parts
    if m < 1:
        raise PartitionError(f"num_parts must be >= 1, got {m}")
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    # best[i][j] = (cost, heaviest, lightest, cut) for the first i items in j parts
    hi = [[inf] * (m + 1) for _ in range(n + 1)]
    lo = [[inf] * (m + 1) for _ in range(n + 1)]
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    hi[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                last = prefix[i] - prefix[k]
                h, l = max(hi[k][j - 1], last), min(lo[k][j - 1], last)
                if cost[i][j] >= h - l:
                    cost[i][j], hi[i][j], lo[i][j], cut[i][j] = h - l, h, l, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(cut[parts[-1]][j])
    return parts[::-1]


def layer_name(layer) -> str:
    """The name a "type:" pattern is matched against: the class of a module or spec, the
    __name__ of a function (a lambda is "<lambda>")."""
    typename = getattr(layer, "typename", None)
    if isinstance(typename, type):
        return typename.__name__
    if callable(layer) and hasattr(layer, "__name__"):
        return layer.__name__
    return type(layer).__name__


def partition_layers(layers: Sequence, num_stages: int, method: str,
                     count_params: Callable[[object], int]) -> List[int]:
    """Boundaries for `method` ("uniform", "parameters", "type:REGEX"); `count_params(layer)`
    gives a layer's trainable parameter count (only called for "parameters")."""
    key = (method or "").lower()
    if key == "uniform":
        return partition_uniform(len(layers), num_stages)
    if key == "parameters":
        return partition_balanced([count_params(layer) for layer in layers], num_stages)
    if key.startswith("type:"):
        pattern = method.split(":", 1)[1]
        try:
            rx = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise PartitionError(f"partition_method {method!r}: bad regular expression ({exc})") from None
        hits = [1 if rx.search(layer_name(layer)) else 0 for layer in layers]
        if not any(hits):
            names = sorted({layer_name(layer) for layer in layers})
            raise PartitionError(f"partition_method {method!r}: no layer's type matches {pattern!r} "
                                 f"(layer types: {', '.join(names)})")
        parts = partition_balanced(hits, num_stages)
        for st in range(num_stages):
            if not any(hits[parts[st]:parts[st + 1]]):
                raise PartitionError(f"partition_method {method!r}: stage {st} is left with no {pattern!r} layer "
                                     f"({sum(hits)} match, {num_stages} stages); use at most {sum(hits)} stages")
        return parts
    raise PartitionError(f"partition_method {method!r}: unknown; use \"parameters\", \"uniform\" or \"type:REGEX\"")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def check_parts(parts: Sequence[int], num_layers: int, describe: Callable[[int], str] = str) -> None:
    """Refuse a partition that leaves a stage without layers (it would have nothing to run
    and nothing to train)."""
    stages = len(parts) - 1
    if num_layers < stages:
        raise PartitionError(f"pipeline: {stages} stages but only {_count(num_layers, 'layer')}; "
                             f"use at most {_count(num_layers, 'stage')}")
    empty = [s for s in range(stages) if parts[s + 1] <= parts[s]]
    if empty:
        raise PartitionError(f"pipeline: stage {empty[0]} gets no layers with boundaries {list(parts)}; "
                             f"use fewer stages or another partition_method (e.g. \"uniform\")")
