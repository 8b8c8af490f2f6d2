"""The shard maths of tensor parallelism: which rows or columns of a full tensor a rank keeps.

Pure functions on sizes, shared by the training layers (layers.py), the automatic sharding
(autotp.py) and the inference planner (plan.py):
- an even split of a dimension (heads, MLP width, a row-parallel input) must divide by tp;
- a fused output ([q|k|v], [gate|up], grouped-query [q|k|v] of unequal widths) is split part
  by part, so every rank holds whole heads of each part, in the original part order;
- a vocabulary is split into tp blocks of ceil(vocab/tp) rows, the last one padded with rows
  no token selects (their logits are trimmed), so any vocabulary size works.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core.config.partition import TensorParallelError  # noqa: F401  (defined with its config key's schema)


def even_range(size: int, tp: int, rank: int) -> Tuple[int, int]:
    """[start, stop) of rank's equal share of `size`; ValueError when tp does not divide it."""
    if size % tp:
        raise ValueError(f"{size} is not divisible by {tp}")
    per = size // tp
    return rank * per, (rank + 1) * per


def vocab_range(vocab: int, tp: int, rank: int) -> Tuple[int, int, int]:
    """(start, stop, rows): rank's rows [start, stop) of a table padded to tp * rows."""
    rows = -(-vocab // tp)
    start = min(rank * rows, vocab)
    return start, min(start + rows, vocab), rows


def part_ranges(parts: Sequence[int], tp: int, rank: int) -> List[Tuple[int, int]]:
    """The ranges of a fused dimension made of `parts` (widths, in order) that rank keeps: its
    even share of each part."""
    out, offset = [], 0
    for width in parts:
        lo, hi = even_range(width, tp, rank)
        out.append((offset + lo, offset + hi))
        offset += width
    return out


def take(full: torch.Tensor, dim: int, ranges: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """The concatenation of `ranges` of `full` along `dim` (a narrow view when there is one)."""
    pieces = [full.narrow(dim, a, b - a) for a, b in ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (the last vocabulary shard)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))], 0)


def linear_shape(module: nn.Module) -> Optional[Tuple[int, int, bool]]:
    """(in_features, out_features, conv1d) for nn.Linear and Hugging Face's Conv1D (duck-typed:
    weight stored [in, out], y = x @ W + b), else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
            and getattr(module, "nf", None) == weight.shape[1]:
        return weight.shape[0], weight.shape[1], True
    return None
