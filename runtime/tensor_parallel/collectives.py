"""The four tensor-parallel region boundaries, as autograd functions on an explicit group.

Megatron's conjugate pairs; each forward has the backward that makes gradients of replicated
activations (and so of replicated parameters) equal to a single process's:

    copy_to_region       forward identity            backward all-reduce (sum)
    reduce_from_region   forward all-reduce (sum)    backward identity
    gather_last_dim      forward all-gather          backward keep this rank's slice
    split_last_dim       forward keep this rank's slice  backward all-gather

A column-parallel layer enters the region with copy_to_region (every rank feeds the same input
to its own output columns, so the input's gradient is the sum of the ranks' contributions); a
row-parallel layer leaves it with reduce_from_region (the sum of partial products is
replicated, and so is its gradient). Every collective runs through dslaunch.runtime.comm on
the group given, labelled with the caller's label (a layer passes its module name), so the
flight record and the comms logger show it on the tensor group. On a group of one rank each
function is the identity. Here `group=None` means no tensor parallelism (this process alone),
not the default group: pass torch.distributed.group.WORLD when the tensor group is the world.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..core import comm


def _size(group) -> int:
    return 1 if group is None else comm.get_world_size(group)


def _all_reduce(t: torch.Tensor, group, label: str) -> torch.Tensor:
    t = t.contiguous().clone()
    comm.all_reduce(t, op=comm.ReduceOp.SUM, group=group, label=label)
    return t


def _gather(t: torch.Tensor, group, label: str) -> torch.Tensor:
    size = _size(group)
    t = t.contiguous()
    flat = t.reshape(1, -1)
    out = torch.empty((size, flat.shape[1]), dtype=t.dtype, device=t.device)
    comm.all_gather_into_tensor(out, flat, group=group, label=label)
    out = out.view((size,) + tuple(t.shape))
    return out.movedim(0, -2).reshape(*t.shape[:-1], size * t.shape[-1])


def _split(t: torch.Tensor, group) -> torch.Tensor:
    size, rank = _size(group), comm.get_rank(group)
    if t.shape[-1] % size:
        raise ValueError(f"tensor parallel: the last dimension {t.shape[-1]} does not divide by {size} ranks")
    per = t.shape[-1] // size
    return t[..., rank * per:(rank + 1) * per].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, f"{ctx.label} (backward)"), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        return _all_reduce(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group = group
        return _gather(x, group, label)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group), None, None


class _SplitLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return _split(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, f"{ctx.label} (backward)"), None, None


def _solo(group) -> bool:
    return group is None or _size(group) == 1


def copy_to_region(x: torch.Tensor, group: Any, label: Optional[str] = None) -> torch.Tensor:
    """Identity forward; the gradient is summed over `group` in backward."""
    return x if _solo(group) else _CopyToRegion.apply(x, group, label or "tp copy to region")


def reduce_from_region(x: torch.Tensor, group: Any, label: Optional[str] = None) -> torch.Tensor:
    """The sum of every rank's `x` (a new tensor); the gradient passes through unchanged."""
    return x if _solo(group) else _ReduceFromRegion.apply(x, group, label or "tp reduce from region")


def gather_last_dim(x: torch.Tensor, group: Any, label: Optional[str] = None) -> torch.Tensor:
    """Every rank's `x` concatenated along the last dimension in group-rank order; backward
    keeps this rank's slice of the gradient."""
    return x if _solo(group) else _GatherLastDim.apply(x, group, label or "tp gather last dim")


def split_last_dim(x: torch.Tensor, group: Any, label: Optional[str] = None) -> torch.Tensor:
    """This rank's equal slice of the last dimension; backward all-gathers the gradient."""
    return x if _solo(group) else _SplitLastDim.apply(x, group, label or "tp split last dim")


def all_reduce_max_(x: torch.Tensor, group: Any, label: Optional[str] = None) -> torch.Tensor:
    """In-place maximum over `group`, no gradient (the vocab-parallel cross-entropy's shift)."""
    if not _solo(group):
        comm.all_reduce(x, op=comm.ReduceOp.MAX, group=group, label=label or "tp max")
    return x
