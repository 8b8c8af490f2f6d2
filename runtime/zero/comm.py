"""Collectives ZeRO needs, correct on every backend.

NCCL has reduce_scatter_tensor / all_gather_into_tensor natively. Older gloo builds
lack them (and some raise only at call time), so the first failure switches this
process to equivalents built from all_reduce / all_gather, which move more bytes but
give the same result. The choice is per process and sticky: every rank hits the same
failure on the same call, so all ranks switch together and never mismatch collectives.

Every function takes the process group it runs on (ZeRO's is the data-parallel group);
sizes and ranks are the group's, and roots are named by their rank in the group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

_native_ok = {"reduce_scatter": True, "all_gather": True}


def _native(*names):
    # looked up per call: torch 2.13 renamed the tensor collectives (*_single) and warns on the
    # old names; and a test may wrap torch.distributed's functions to count collectives
    for n in names:
        fn = getattr(dist, n, None)
        if fn is not None:
            return fn
    return None


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


def world(group=None) -> int:
    """Size of `group` (the default group when None); 1 without torch.distributed."""
    return dist.get_world_size(group) if _on() else 1


def rank(group=None) -> int:
    """This process's rank within `group`; 0 without torch.distributed."""
    return dist.get_rank(group) if _on() else 0


def global_rank(group, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank` (point-to-point and rooted
    collectives name their peer by global rank)."""
    if group is None or not _on() or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group=None) -> None:
    """out <- sum over the group of flat[r*n:(r+1)*n] for this rank r (n = out.numel())."""
    n = world(group)
    if n == 1:
        out.copy_(flat)
        return
    native = _native("reduce_scatter_single", "reduce_scatter_tensor")
    if _native_ok["reduce_scatter"] and native is not None:
        try:
            native(out, flat, group=group)
            return
        except (RuntimeError, NotImplementedError, ValueError):
            _native_ok["reduce_scatter"] = False
    buf = flat.clone()
    dist.all_reduce(buf, group=group)
    r = dist.get_rank(group)
    out.copy_(buf[r * out.numel():(r + 1) * out.numel()])


def all_gather(flat_out: torch.Tensor, shard: torch.Tensor, group=None) -> None:
    """flat_out <- concatenation of every group rank's shard, in group-rank order."""
    n = world(group)
    if n == 1:
        flat_out.copy_(shard)
        return
    native = _native("all_gather_single", "all_gather_into_tensor")
    if _native_ok["all_gather"] and native is not None:
        try:
            native(flat_out, shard, group=group)
            return
        except (RuntimeError, NotImplementedError, ValueError):
            _native_ok["all_gather"] = False
    dist.all_gather(list(flat_out.chunk(n)), shard, group=group)


def all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    if world(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def reduce_sum(t: torch.Tensor, dst: int, group=None) -> torch.Tensor:
    """Sum `t` over the group into group rank `dst`."""
    if world(group) > 1:
        dist.reduce(t, dst=global_rank(group, dst), group=group)
    return t


def broadcast(t: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """From group rank `src` to the rest of the group."""
    if world(group) > 1:
        dist.broadcast(t, global_rank(group, src), group=group)
    return t


def all_gather_object(obj, group=None) -> list:
    n = world(group)
    if n == 1:
        return [obj]
    out: list = [None] * n
    dist.all_gather_object(out, obj, group=group)
    return out


def force_fallback(enabled: bool = True, which: Optional[str] = None) -> None:
    """Tests use this to exercise the gloo-equivalent paths on a backend that has the
    native collectives."""
    for k in ([which] if which else list(_native_ok)):
        _native_ok[k] = not enabled
