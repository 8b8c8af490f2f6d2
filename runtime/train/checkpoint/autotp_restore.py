"""This rank's piece of an AutoTP parameter from its full tensor in a universal checkpoint
(DeepSpeed 0.19.8's `_resolve_autotp_partition` and `_narrow_sub_params`,
deepspeed.checkpoint.universal_checkpoint).

The layer wrote how it split the parameter onto the parameter itself
(tensor_parallel/uc_meta.py, DS_AUTOTP_UC_META); restoring reads that back: replicated
parameters are whole, sub-parameters give one piece each (at the widths recorded since
universal-checkpoint version 0.4, evenly before), a frozen uneven split its block, and
otherwise an even split. A layout the layer could not describe is refused: a rank-order guess
would silently restore a wrong weight. Every refusal is one CheckpointError line.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch

from ...core.errors import CheckpointError
from ...tensor_parallel.shard import TensorParallelError
from ...tensor_parallel.subparams import check_shard_widths, even_widths, take_rank_pieces
from .constants import DS_AUTOTP_UC_META, UNIVERSAL_CHECKPOINT_VERSION_KEY


def narrow_sub_params(full_view: torch.Tensor, partition_dim: int, sub_dim_sizes: Sequence[int], shard_widths,
                      tp_rank: int, tp_world_size: int, uc_version: float) -> torch.Tensor:
    """Rank `tp_rank`'s piece of every sub-parameter of `full_view` along `partition_dim`,
    concatenated and flattened. A checkpoint older than 0.4 records no widths: only an even
    split can be rebuilt, and an uneven sub-parameter is refused."""
    if sum(sub_dim_sizes) != full_view.shape[partition_dim]:
        raise CheckpointError(f"sub-parameter sizes {list(sub_dim_sizes)} sum to {sum(sub_dim_sizes)}, but dimension "
                              f"{partition_dim} of the parameter is {full_view.shape[partition_dim]}: the metadata "
                              f"describes another parameter")
    try:
        if uc_version < 0.4 or shard_widths is None:
            shard_widths = even_widths(sub_dim_sizes, tp_world_size)
        check_shard_widths(shard_widths, sub_dim_sizes, tp_world_size)
    except TensorParallelError as exc:
        raise CheckpointError(f"universal checkpoint restore: {exc}") from None
    return take_rank_pieces(full_view, partition_dim, sub_dim_sizes, shard_widths, tp_rank).flatten()


def resolve_autotp_partition(current_param: torch.Tensor, ckpt_dict: Dict[str, Any], full_hp_param: torch.Tensor,
                             tp_rank: int, tp_world_size: int, state_key: str = "fp32") -> Optional[torch.Tensor]:
    """This rank's piece (flattened) of `full_hp_param` for `current_param`, or None when the
    parameter carries no AutoTP description (the caller's own rules apply then). `state_key`
    (which optimizer state) matters in DeepSpeed only for its affine layout maps, which are not
    written here, so every state is cut the same way."""
    meta = getattr(current_param, DS_AUTOTP_UC_META, None)
    if not meta:
        return None
    reason = (meta.get("conversion") or {}).get("unsupported_reason")
    if reason:
        raise CheckpointError(f"cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    dim, logical = meta.get("partition_dim"), meta.get("logical_shape")
    if meta.get("replicated"):
        return full_hp_param.flatten()
    if dim is None or logical is None:
        return None
    if full_hp_param.numel() != torch.Size(logical).numel():
        raise CheckpointError(f"universal checkpoint restore: the saved tensor has {full_hp_param.numel()} elements, "
                              f"the AutoTP parameter's logical shape {tuple(logical)} needs "
                              f"{torch.Size(logical).numel()}")
    full_view = full_hp_param.view(logical)
    # sub_param_sizes are real widths; sub_param_shape's split entry may be a *count* ((3, -1)),
    # so it is read only from metadata that predates the sizes
    sizes = meta.get("sub_param_sizes")
    if sizes is None and meta.get("sub_param_shape") is not None:
        sizes = meta["sub_param_shape"][dim]
    if sizes is not None:
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
        return narrow_sub_params(full_view, dim, sizes, meta.get("sub_param_shard_widths"), tp_rank, tp_world_size,
                                 meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
    partition_sizes = meta.get("partition_sizes")
    if partition_sizes is not None:
        start = sum(partition_sizes[:tp_rank])
        return full_view.narrow(dim, start, partition_sizes[tp_rank]).flatten()
    # no recorded split: only the even one is recoverable (torch.chunk would differ when uneven)
    if full_view.shape[dim] % tp_world_size:
        raise CheckpointError(f"universal checkpoint restore: dimension {dim} of {full_view.shape[dim]} does not "
                              f"divide by tp {tp_world_size} and the checkpoint records no partition_sizes")
    width = full_view.shape[dim] // tp_world_size
    return full_view.narrow(dim, tp_rank * width, width).flatten()
