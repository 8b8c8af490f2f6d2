"""This rank's piece of an AutoTP parameter from its full tensor in a universal checkpoint
(DeepSpeed 0.19.8's `_resolve_autotp_partition` and `_narrow_sub_params`,
deepspeed.checkpoint.universal_checkpoint).

The layer wrote how it split the parameter onto the parameter itself
(tensor_parallel/uc_meta.py, DS_AUTOTP_UC_META); restoring reads that back: replicated
parameters are whole, sub-parameters give one piece each (at the widths recorded since
universal-checkpoint version 0.4, evenly before), a frozen uneven split its block, and
otherwise an even split. A layout the layer could not describe is refused: a rank-order guess
would silently restore a wrong weight. Every refusal is one CheckpointError line (an
AssertionError too where DeepSpeed asserts: UniversalLayoutError).

`load_hp_checkpoint_state` is DeepSpeed's per-parameter loader of one universal folder into a
parameter that carries DeepSpeed's hp-fragment mapping (`_hp_mapping`: the fp32 fragment it
owns and the optimizer-state fragments it hands the optimizer); dslaunch's engine loads
universal checkpoints itself (universal.py) and sets no such mapping, so a parameter
without one is refused in one line.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

import torch

from ...core.errors import CheckpointError
from ...tensor_parallel.shard import TensorParallelError
from ...tensor_parallel.subparams import check_shard_widths, even_widths, take_rank_pieces
from .constants import (CAT_DIM, DS_AUTOTP_UC_META, FP32_WEIGHT_KEY, PARAM, PARAM_N_SUB_PARAMS, SUB_PARAM_SHAPE,
                        UNIVERSAL_CHECKPOINT_VERSION_KEY, VOCAB_TENSOR)
from .files import load_torch
from .tp_merge import UniversalLayoutError

EP_IS_EXPERT_PARAM = "is_expert_param"  # DeepSpeed's mark on an AutoEP expert tensor in a universal folder


def get_param_uc_restore_meta(param: Any) -> Optional[Dict[str, Any]]:
    """The restore description an AutoTP layer put on its parameter (top-level keys; what
    the converter needs sits under "conversion"), or None."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def narrow_sub_params(full_view: torch.Tensor, partition_dim: int, sub_dim_sizes: Sequence[int], shard_widths,
                      tp_rank: int, tp_world_size: int, uc_version: float) -> torch.Tensor:
    """Rank `tp_rank`'s piece of every sub-parameter of `full_view` along `partition_dim`,
    concatenated and flattened. A checkpoint older than 0.4 records no widths: only an even
    split can be rebuilt, and an uneven sub-parameter is refused."""
    if sum(sub_dim_sizes) != full_view.shape[partition_dim]:
        raise CheckpointError(f"sub-parameter sizes {list(sub_dim_sizes)} sum to {sum(sub_dim_sizes)}, but dimension "
                              f"{partition_dim} of the parameter is {full_view.shape[partition_dim]}: the metadata "
                              f"describes another parameter")
    if uc_version < 0.4 or shard_widths is None:
        # only an even split is recoverable without widths; assuming it for an uneven
        # sub-parameter would shift every cut after it
        shard_widths, uneven = even_widths(sub_dim_sizes, tp_world_size)
        if shard_widths is None:
            raise UniversalLayoutError(f"sub-parameter sizes {uneven} are not divisible by tp_world_size "
                                       f"{tp_world_size} and the metadata records no sub_param_shard_widths, so "
                                       f"its uneven split cannot be rebuilt")
    try:
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
    meta = get_param_uc_restore_meta(current_param)
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
    sub_shape = meta.get("sub_param_shape")
    if sizes is None and sub_shape is not None:
        if hasattr(sub_shape, "partition_dim"):  # a SubparamShape record names its own dimension
            dim, sub_shape = sub_shape.partition_dim, sub_shape.shape
        sizes = sub_shape[dim]
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
        raise UniversalLayoutError(f"universal checkpoint restore: dimension {dim} of size {full_view.shape[dim]} "
                                   f"is not divisible by tp_world_size {tp_world_size} and the checkpoint records "
                                   f"no partition_sizes")
    width = full_view.shape[dim] // tp_world_size
    return full_view.narrow(dim, tp_rank * width, width).flatten()


def _legacy_cut(param: torch.Tensor, record: Dict[str, Any], full: torch.Tensor, tp_rank: int,
                tp_world_size: int, path: str) -> torch.Tensor:
    """This rank's piece of a parameter without AutoTP metadata, by the merged file's own
    keys: per sub-parameter (sub_param_shape), per half (param_n_sub_params) or along
    cat_dim; each cut even, as the old merge wrote it."""
    if full.numel() != tp_world_size * param.numel():
        raise UniversalLayoutError(f"universal checkpoint file {path}: {full.numel()} elements, the parameter's "
                                   f"{param.numel()} times tp {tp_world_size} expected")
    sub = record.get(SUB_PARAM_SHAPE)
    dim = record.get(CAT_DIM, 0)
    if sub:
        sizes = sub.shape[sub.partition_dim]
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
        view = full.view([sum(d) if isinstance(d, (tuple, list)) else d for d in sub.shape])
        pieces, offset = [], 0
        for size in sizes:
            pieces.append(view.narrow(sub.partition_dim, offset, size).chunk(tp_world_size, sub.partition_dim)[tp_rank])
            offset += size
        return torch.cat(pieces, dim=sub.partition_dim).flatten()
    n_sub = record.get(PARAM_N_SUB_PARAMS, 1)
    if n_sub > 1:
        return torch.cat([p.chunk(tp_world_size, dim)[tp_rank] for p in full.chunk(n_sub, dim)], dim).flatten()
    return full.chunk(tp_world_size, dim)[tp_rank].flatten()


def load_hp_checkpoint_state(self: torch.Tensor, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0,
                             ep_size: int = 1) -> Any:
    """Load one parameter's universal folder (<state>.pt files, step.pt) into the parameter's
    hp-fragment mapping: the fp32 fragment is overwritten, each optimizer state's fragment is
    handed over in `_hp_mapping.optim_fragment`; returns the step (None without step.pt)."""
    mapping = getattr(self, "_hp_mapping", None)
    if mapping is None:
        raise CheckpointError(f"load_hp_checkpoint_state({folder}): the parameter carries no DeepSpeed hp-fragment "
                              "mapping (_hp_mapping); dslaunch's engine loads universal checkpoints itself "
                              "(checkpoint.load_universal)")
    mapping.optim_fragment = {}
    has_meta = get_param_uc_restore_meta(self) is not None
    step = None
    for fname in sorted(os.listdir(folder)):
        if not fname.endswith(".pt"):
            continue
        key, path = fname[:-3], os.path.join(folder, fname)
        record = load_torch(path)
        if key == "step":
            step = record
            continue
        if not isinstance(record, dict) or not torch.is_tensor(record.get(PARAM)):
            raise CheckpointError(f"universal checkpoint file {path} holds no {{'{PARAM}': tensor}} record")
        if record.get(EP_IS_EXPERT_PARAM):
            raise CheckpointError(f"universal checkpoint file {path} holds an AutoEP expert parameter; restoring "
                                  "expert-parallel universal checkpoints is not supported here")
        full = record[PARAM]
        rank, world = tp_rank, tp_world_size
        if full.shape == self.shape and not has_meta:
            rank, world = 0, 1  # saved whole (replicated or averaged): every rank takes all of it
        if record.get(VOCAB_TENSOR) and not has_meta:
            # the merge stripped the vocabulary's padding; pad again for this tp size
            padded = self.shape[0] * world
            if padded < full.shape[0]:
                raise UniversalLayoutError(f"universal checkpoint file {path}: vocabulary of {full.shape[0]} rows "
                                           f"exceeds this model's {padded}")
            full = torch.nn.functional.pad(full, (0, 0, 0, padded - full.shape[0]))
        piece = resolve_autotp_partition(self, record, full, rank, world, state_key=key)
        if piece is None:
            piece = _legacy_cut(self, record, full, rank, world, path)
        address = mapping.lp_fragment_address
        if address.start + address.numel > piece.numel():
            raise UniversalLayoutError(f"universal checkpoint file {path}: this rank's piece has {piece.numel()} "
                                       f"elements, the fragment needs [{address.start}, "
                                       f"{address.start + address.numel})")
        fragment = piece.narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            dst = mapping.get_hp_fragment()
            if dst.numel() != address.numel:
                raise UniversalLayoutError(f"universal checkpoint file {path}: the fp32 fragment holds {dst.numel()} "
                                           f"elements, the mapping's address {address.numel}")
            dst.data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step
