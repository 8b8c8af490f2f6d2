"""DeepSpeed's per-head helpers for AutoTP models (`deepspeed.module_inject.auto_tp_model_utils`):
ALiBi position biases and attention-bias tensors cut down to this rank's attention heads, the
same heads AutoTP's split of the attention weights left here.

    build_bloom_alibi_tensor(attention_mask, num_heads, dtype, ...)  BLOOM's ALiBi, local heads
    build_mpt_alibi_tensor(self, num_heads, sequence_length, ...)    wraps MPT's own builder
    build_mpt_atten_bias_tensor(self, device, dtype, ...)            wraps MPT's _attn_bias
    get_alibi_mask(self, tensor, seq_length_with_past, ...)          wraps Baichuan's get_alibi_mask
    install_head_sharded_helper(module, name, wrapper, ...)          binds one of the wrappers
                                                                     to one model instance
    get_head_shard_sizes(...)                                        every rank's head count

The wrappers call the model's own method for all heads (`<name>_orig`, recorded when installed)
and keep this rank's rows. The split is the one recorded when the helper was installed
(`head_shard_sizes`, with the model's total head count), so another model changing tp_shard's
settings later does not move it; without one, the heads are split near-evenly.

Two calling conventions are answered, as in tp_shard.py: DeepSpeed 0.19.8 passes the model's
AutoTPMeta (`install_head_sharded_helper(module, name, wrapper, meta, mp_group)`,
`get_head_shard_sizes(meta, mp_group)`); its earlier tree passes the head counts
(`install_head_sharded_helper(module, name, wrapper, mp_group=None, num_heads=None,
num_kv_heads=None)`, `get_head_shard_sizes(num_heads, mp_group, num_kv_heads)`). The type of
the fourth (first) argument tells them apart.

Without torch.distributed initialized, every head is kept (one process holds the model).
"""
from __future__ import annotations

import functools
import math
from typing import Any, List, Optional, Tuple

import torch

from ..core import comm
from .tp_shard import AutoTPMeta, bind_convention, get_shard_size_list

__all__ = ["build_bloom_alibi_tensor", "build_mpt_alibi_tensor", "build_mpt_atten_bias_tensor", "get_alibi_mask",
           "get_head_shard_sizes", "install_head_sharded_helper"]


class _TotalHeads:
    """`module` seen with its original head count: Baichuan's get_alibi_mask reads self.n_head,
    which AutoTP set to the local count; every other attribute read or written is the module's."""

    def __init__(self, module: Any, total_num_heads: int):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "n_head", total_num_heads)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "n_head":
            object.__setattr__(self, name, value)
        else:
            setattr(self._module, name, value)


def get_head_shard_sizes(meta_or_num_heads: Any, mp_group: Any = None, num_kv_heads: Optional[int] = None) -> List[int]:
    """Every tensor-parallel rank's attention-head count, in rank order: the model's meta
    (0.19.8) gives its head count and kv-head split; a head count (earlier convention) is split
    by `num_kv_heads` when given, else by tp_shard's module settings."""
    world = comm.get_world_size(group=mp_group)
    if isinstance(meta_or_num_heads, AutoTPMeta):
        return get_shard_size_list(meta_or_num_heads.num_attention_heads, world, meta_or_num_heads)
    return get_shard_size_list(meta_or_num_heads, world, num_kv_heads=num_kv_heads)


def install_head_sharded_helper(module: Any, name: str, wrapper: Any, *args: Any, **kwargs: Any) -> None:
    """Bind `wrapper` to this instance as its method `name`, the instance's own method kept as
    `<name>_orig` (the class is untouched: later instances and subclasses keep theirs, and a
    second install on the same instance does not wrap the wrapper)."""
    meta, mp_group, num_heads, num_kv_heads = _install_args(args, kwargs)
    original = f"{name}_orig"
    if original not in module.__dict__:
        setattr(module, original, getattr(module, name))
    if meta is not None:
        total = meta.num_attention_heads
        sizes = get_head_shard_sizes(meta, mp_group) if total is not None else None
    else:
        total = num_heads
        sizes = get_head_shard_sizes(num_heads, mp_group, num_kv_heads) if num_heads is not None else None
    setattr(module, name, functools.partial(wrapper, module, mp_group=mp_group, head_shard_sizes=sizes,
                                            total_num_heads=total))


def _install_args(args: tuple, kwargs: dict) -> Tuple[Optional[AutoTPMeta], Any, Optional[int], Optional[int]]:
    """(meta, mp_group, num_heads, num_kv_heads) from either convention (module docstring);
    the helper binds three arguments of its own first."""
    _, bound = bind_convention("install_head_sharded_helper", (("meta", "mp_group"),
                                                               ("mp_group", "num_heads", "num_kv_heads")),
                               args, kwargs, fixed=3)
    return bound.get("meta"), bound.get("mp_group"), bound.get("num_heads"), bound.get("num_kv_heads")


def _head_shard(num_heads: int, mp_group: Any = None, head_shard_sizes: Optional[List[int]] = None,
                total_num_heads: Optional[int] = None) -> Tuple[int, int]:
    """(this rank's head count, its first head) in the group's split of the model's heads."""
    world = comm.get_world_size(group=mp_group)
    rank = comm.get_rank(group=mp_group)
    full = total_num_heads if total_num_heads is not None else num_heads
    # no recorded split: the model is not kv-head aware, so the plain near-even split
    sizes = head_shard_sizes or get_shard_size_list(full, world, AutoTPMeta())
    if len(sizes) != world or sum(sizes) != full:
        raise ValueError(f"Head shard sizes {list(sizes)} do not partition {full} heads across {world} "
                         "tensor-parallel ranks.")
    return sizes[rank], sum(sizes[:rank])


def _alibi_slopes(num_heads: int, device: Any) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al.): a geometric series from 2^(-8/n) for the largest
    power of two n <= heads, the remaining heads taking every other slope of the series for 2n."""
    n = 2 ** math.floor(math.log2(num_heads))
    ratio = 2.0 ** (-8.0 / n)
    slopes = torch.pow(torch.tensor(ratio, dtype=torch.float32, device=device),
                       torch.arange(1, n + 1, dtype=torch.int32, device=device))
    if n != num_heads:
        extra_ratio = 2.0 ** (-8.0 / (2 * n))
        extra = min(n, num_heads - n)
        odd = torch.arange(1, 1 + 2 * extra, 2, dtype=torch.int32, device=device)
        slopes = torch.cat([slopes, torch.pow(torch.tensor(extra_ratio, dtype=torch.float32, device=device), odd)])
    return slopes


def build_bloom_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype, mp_group: Any = None,
                             head_shard_sizes: Optional[List[int]] = None,
                             total_num_heads: Optional[int] = None) -> torch.Tensor:
    """BLOOM's ALiBi bias for a (batch, seq) attention mask: slope x the position of each
    attended token, shaped (batch * heads, 1, seq), only this rank's heads when distributed."""
    heads = total_num_heads if total_num_heads is not None else num_heads
    batch, seq = attention_mask.shape
    slopes = _alibi_slopes(heads, attention_mask.device)
    positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * positions  # (batch, heads, seq)
    if not comm.is_initialized():
        return alibi.reshape(batch * heads, 1, seq).to(dtype)
    local, first = _head_shard(heads, mp_group, head_shard_sizes, total_num_heads)
    alibi = alibi.view(batch, heads, 1, seq)[:, first:first + local]
    return alibi.reshape(batch * local, 1, seq).to(dtype)


def get_alibi_mask(self: Any, tensor: Any, seq_length_with_past: int, mp_group: Any = None,
                   head_shard_sizes: Optional[List[int]] = None, total_num_heads: Optional[int] = None):
    """Baichuan's get_alibi_mask computed for all the model's heads, cut to this rank's."""
    original = self.get_alibi_mask_orig
    if total_num_heads is not None and self.n_head != total_num_heads:
        function = getattr(original, "__func__", None)
        if function is None:
            raise TypeError("Cannot invoke get_alibi_mask with the original total head count.")
        mask = function(_TotalHeads(self, total_num_heads), tensor, seq_length_with_past)
    else:
        mask = original(tensor, seq_length_with_past)
    if comm.is_initialized():
        local, first = _head_shard(self.n_head, mp_group, head_shard_sizes, total_num_heads)
        mask = mask[first:first + local, :seq_length_with_past, :seq_length_with_past]
    return mask


def build_mpt_atten_bias_tensor(self: Any, device: Any, dtype: torch.dtype, attention_mask=None, prefix_mask=None,
                                sequence_id=None, mp_group: Any = None, head_shard_sizes: Optional[List[int]] = None,
                                total_num_heads: Optional[int] = None):
    """MPT's _attn_bias with its head dimension (1) cut to this rank's heads."""
    attn_bias, attention_mask = self._attn_bias_orig(device, dtype, attention_mask=attention_mask,
                                                     prefix_mask=prefix_mask, sequence_id=sequence_id)
    if comm.is_initialized():
        local, first = _head_shard(self.config.n_heads, mp_group, head_shard_sizes, total_num_heads)
        attn_bias = attn_bias[:, first:first + local, :, :]
    return attn_bias, attention_mask


def build_mpt_alibi_tensor(self: Any, num_heads: int, sequence_length: int, alibi_bias_max: int = 8, device=None,
                           mp_group: Any = None, head_shard_sizes: Optional[List[int]] = None,
                           total_num_heads: Optional[int] = None) -> torch.Tensor:
    """MPT's own ALiBi builder run for all the model's heads, cut to this rank's."""
    full = total_num_heads if total_num_heads is not None else num_heads
    alibi = self.build_mpt_alibi_tensor_orig(full, sequence_length, alibi_bias_max, device)
    if comm.is_initialized():
        local, first = _head_shard(num_heads, mp_group, head_shard_sizes, total_num_heads)
        alibi = alibi[first:first + local, :, :]
    return alibi
