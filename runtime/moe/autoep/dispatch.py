"""Moving routed tokens to the ranks that hold their experts, and back.

Global expert e lives on expert-parallel rank e // local experts, as its local expert
e % local experts. A rank's routed rows, sorted by global expert, are therefore already
grouped by destination rank, each destination's block ordered by its local expert:

    plan        counts [experts] -> the [ep, local] matrix, exchanged with one all-to-all:
                received[s, j] = rows source rank s sends this rank for its local expert j
    dispatch    all-to-all with uneven splits (send: row sums of counts; receive: of received);
                rows arrive grouped by source, and are regrouped by local expert for the experts
    combine     the inverse regrouping, and the reverse all-to-all

Every collective runs on the layer's expert-parallel group (the mesh's `expert` axis).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch


@dataclass
class SplitPlan:
    send: List[int]  # rows to each expert-parallel rank
    recv: List[int]  # rows from each
    per_expert: List[int]  # rows each local expert gets, from all sources
    regroup: torch.Tensor  # received row order -> grouped by local expert
    restore: torch.Tensor  # its inverse


def plan(counts: torch.Tensor, ep_size: int, group, label: str) -> SplitPlan:
    """counts [experts]: this rank's rows per global expert (collective over `group`)."""
    from ...core import comm

    local = counts.numel() // ep_size
    matrix = counts.reshape(ep_size, local)
    received = torch.empty_like(matrix)
    comm.all_to_all_single(received.view(-1), matrix.reshape(-1).contiguous(), group=group,
                           label=f"{label} (token counts)")
    send, recv = matrix.sum(1).tolist(), received.sum(1).tolist()
    # local expert of each received row (grouped by source, then expert), then a stable sort
    owner = torch.arange(local, device=counts.device).repeat(ep_size).repeat_interleave(received.reshape(-1))
    regroup = torch.argsort(owner, stable=True)
    restore = torch.empty_like(regroup)
    restore[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    return SplitPlan(send, recv, received.sum(0).tolist(), regroup, restore)


class AllToAllV(torch.autograd.Function):
    """Rows to each rank of `group` by `send` sizes, `recv` from each; the gradient goes back
    the same way reversed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: List[int], recv: List[int], group, label: str) -> torch.Tensor:
        from ...core import comm

        ctx.send, ctx.recv, ctx.group, ctx.label = send, recv, group, label
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group,
                               label=label)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return AllToAllV.apply(grad, ctx.recv, ctx.send, ctx.group, ctx.label + " (backward)"), None, None, None, None
