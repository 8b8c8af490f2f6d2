"""The maths of a fused weight split per sub-parameter (DeepSpeed's SubParam* AutoTP layers).

A fused weight (q|k|v, gate|up) holds several sub-parameters side by side along one dimension.
Splitting it for tensor parallelism cuts every sub-parameter separately and gives each rank one
piece of each, concatenated in sub-parameter order. Everything here is pure tensor/shape logic:
the layers (autotp_subparam_layers.py) and the universal-checkpoint restore
(train/checkpoint/autotp_restore.py) share it so they agree on where each cut falls.

A layer's `shape` spec views the weight: one entry per dimension, -1 for "infer", and at
`partition_dim` either a sub-parameter count (3: three equal parts) or their sizes ((q, k, v)).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional, Sequence, Tuple

import torch

from .shard import TensorParallelError
from .tp_shard import AutoTPMeta, get_shard_size_list

Widths = Tuple[Tuple[int, ...], ...]  # per sub-parameter, each rank's width


@dataclass(frozen=True)
class SubParamLayout:
    """A weight viewed through a shape spec: its logical shape, the output part of it (all but
    the last, input, dimension), the sub-parameter sizes at the partition dimension (None: one
    whole parameter), and the dimension a bias of the output shape is split along (None: the
    split falls on the input dimension, so the bias is whole on every rank)."""

    logical_shape: Tuple[int, ...]
    output_shape: Tuple[int, ...]
    sub_sizes: Optional[Tuple[int, ...]]
    bias_partition_dim: Optional[int]


def _as_spec(shape) -> tuple:
    if isinstance(shape, (list, tuple)):
        return tuple(tuple(d) if isinstance(d, list) else d for d in shape)
    raise TensorParallelError(f"AutoTP sub-parameter shape {shape!r} must be a tuple of dimensions")


def infer_layout(weight_shape: Sequence[int], shape, partition_dim: int, name: Optional[str] = None
                 ) -> SubParamLayout:
    """Resolve a shape spec against a [out, in] weight; a spec that cannot describe the weight is
    one TensorParallelError naming the layer."""
    who = f"AutoTP layer {name!r}" if name else "AutoTP layer"
    spec = _as_spec(shape)
    if not 0 <= partition_dim < len(spec):
        raise TensorParallelError(f"{who}: partition_dim {partition_dim} is outside shape {spec}")
    dims: list = []
    sub_sizes: Optional[Tuple[int, ...]] = None
    count: Optional[int] = None
    for i, d in enumerate(spec):
        if i == partition_dim and isinstance(d, tuple):
            if not d or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in d):
                raise TensorParallelError(f"{who}: sub-parameter sizes {d} must be positive integers")
            # a 2-D view is the weight itself: name the mismatch rather than fail to infer
            if len(spec) == len(weight_shape) and sum(d) != weight_shape[partition_dim]:
                raise TensorParallelError(f"{who}: sub-parameter sizes {d} sum to {sum(d)}, not the weight's "
                                          f"{weight_shape[partition_dim]}")
            sub_sizes = tuple(d)
            dims.append(sum(d))
        elif isinstance(d, int) and not isinstance(d, bool) and (d == -1 or d > 0):
            if i == partition_dim and d > 0:
                count, d = d, -1  # a count of equal sub-parameters, the size itself inferred
            dims.append(None if d == -1 else d)
        else:
            raise TensorParallelError(f"{who}: shape entry {d!r} must be a positive integer or -1"
                                      + (" (a size tuple only at partition_dim)" if isinstance(d, tuple) else ""))
    numel = prod(weight_shape)
    unknown = [i for i, d in enumerate(dims) if d is None]
    known = prod(d for d in dims if d is not None)
    if len(unknown) == 1 and numel % known == 0:
        dims[unknown[0]] = numel // known
    elif len(unknown) > 1 and len(dims) == len(weight_shape):
        for i in unknown:
            dims[i] = weight_shape[i]
    elif unknown:
        raise TensorParallelError(f"{who}: shape {spec} cannot be inferred for a weight of {tuple(weight_shape)}")
    logical = tuple(dims)
    if prod(logical) != numel or logical[-1] != weight_shape[-1] or len(logical) < 2 \
            or prod(logical[:-1]) != weight_shape[0]:
        raise TensorParallelError(f"{who}: shape {spec} (as {logical}) does not view a weight of "
                                  f"{tuple(weight_shape)} (its last dimension must be the input)")
    if count is not None:
        if logical[partition_dim] % count:
            raise TensorParallelError(f"{who}: dimension {logical[partition_dim]} does not split into {count} "
                                      f"equal sub-parameters")
        sub_sizes = (logical[partition_dim] // count,) * count
    output = logical[:-1]
    return SubParamLayout(logical, output, sub_sizes, partition_dim if partition_dim < len(output) else None)


def bias_shape_spec(layout: SubParamLayout) -> Optional[Tuple]:
    """The bias's own fully resolved spec (its output shape, sizes at the split dimension);
    None when the bias is not split."""
    if layout.bias_partition_dim is None:
        return None
    spec = list(layout.output_shape)
    if layout.sub_sizes is not None:
        spec[layout.bias_partition_dim] = tuple(layout.sub_sizes)
    return tuple(spec)


def subparam_shard_widths(sub_sizes: Sequence[int], tp_world_size: int, meta: Optional[AutoTPMeta] = None,
                          name: Optional[str] = None) -> list:
    """Each sub-parameter's per-rank widths (a list per sub-parameter), by the same split as an
    ordinary layer's dimension (kv-head and grain aware), so a fused attention weight is cut on
    head boundaries. Without `meta` the process-wide tp_shard settings decide. A width can be
    0: with more ranks than kv heads some ranks hold none of a sub-parameter."""
    if meta is not None:
        return [list(get_shard_size_list(size, tp_world_size, meta, name)) for size in sub_sizes]
    return [list(get_shard_size_list(size, tp_world_size, name)) for size in sub_sizes]


def check_shard_widths(widths, sub_sizes: Sequence[int], tp_world_size: int) -> None:
    """The widths must give every rank a width of every sub-parameter and tile each exactly."""
    if len(widths) != len(sub_sizes):
        raise TensorParallelError(f"{len(widths)} shard-width lists for {len(sub_sizes)} sub-parameters")
    for size, per_rank in zip(sub_sizes, widths):
        if len(per_rank) != tp_world_size or sum(per_rank) != size:
            raise TensorParallelError(f"shard widths {list(per_rank)} do not tile a sub-parameter of {size} "
                                      f"over {tp_world_size} ranks")


def take_rank_pieces(full: torch.Tensor, dim: int, sub_sizes: Sequence[int], widths, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of every sub-parameter of `full` along `dim`, concatenated (a view
    per piece, one cat)."""
    check_shard_widths(widths, sub_sizes, len(widths[0]) if widths else 0)
    pieces, offset = [], 0
    for size, per_rank in zip(sub_sizes, widths):
        pieces.append(full.narrow(dim, offset + sum(per_rank[:rank]), per_rank[rank]))
        offset += size
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def even_widths(sub_sizes: Sequence[int], tp_world_size: int) -> Tuple[Optional[list], list]:
    """(the equal split, the sizes that do not divide by `tp_world_size`). The equal split is
    the only layout a checkpoint without recorded widths can describe; it is None when a
    sub-parameter does not divide evenly, since guessing would shift every cut after it (each
    caller refuses in its own words)."""
    uneven = [s for s in sub_sizes if s % tp_world_size]
    if uneven:
        return None, uneven
    return [[s // tp_world_size] * tp_world_size for s in sub_sizes], uneven
