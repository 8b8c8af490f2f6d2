"""Collectives ZeRO needs, correct on every backend.

NCCL has reduce_scatter_tensor / all_gather_into_tensor natively. Older gloo builds
lack them (and some raise only at call time), so the first failure switches this
process to equivalents built from all_reduce / all_gather, which move more bytes but
give the same result. The choice is per process and sticky: every rank hits the same
failure on the same call, so all ranks switch together and never mismatch collectives.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_native_ok = {"reduce_scatter": True, "all_gather": True}
# torch 2.13 renamed the tensor collectives (*_single) and warns on the old names
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group=None) -> None:
    """out <- sum over ranks of flat[r*n:(r+1)*n] for this rank r (n = out.numel())."""
    n = world()
    if n == 1:
        out.copy_(flat)
        return
    if _native_ok["reduce_scatter"] and _REDUCE_SCATTER is not None:
        try:
            _REDUCE_SCATTER(out, flat, group=group)
            return
        except (RuntimeError, NotImplementedError, ValueError):
            _native_ok["reduce_scatter"] = False
    buf = flat.clone()
    dist.all_reduce(buf, group=group)
    r = dist.get_rank(group)
    out.copy_(buf[r * out.numel():(r + 1) * out.numel()])


def all_gather(flat_out: torch.Tensor, shard: torch.Tensor, group=None) -> None:
    """flat_out <- concatenation of every rank's shard, in rank order."""
    n = world()
    if n == 1:
        flat_out.copy_(shard)
        return
    if _native_ok["all_gather"] and _ALL_GATHER is not None:
        try:
            _ALL_GATHER(flat_out, shard, group=group)
            return
        except (RuntimeError, NotImplementedError, ValueError):
            _native_ok["all_gather"] = False
    dist.all_gather(list(flat_out.chunk(n)), shard, group=group)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if world() > 1:
        dist.all_reduce(t, group=group)
    return t


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    if world() > 1:
        dist.broadcast(t, src, group=group)
    return t


def all_gather_object(obj, group=None) -> list:
    if world() == 1:
        return [obj]
    out: list = [None] * world()
    dist.all_gather_object(out, obj, group=group)
    return out


def force_fallback(enabled: bool = True, which: Optional[str] = None) -> None:
    """Tests use this to exercise the gloo-equivalent paths on a backend that has the
    native collectives."""
    for k in ([which] if which else list(_native_ok)):
        _native_ok[k] = not enabled
