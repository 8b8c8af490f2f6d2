"""The whole sequence from every rank's slice of it, with autograd (uneven slices allowed).

    full, lengths = gather_sequence(x, group)    x: [b, s_r, ...] -> full: [b, sum(s_r), ...]
    mine = own_slice(y, lengths, group)          y: [b, sum(s_r), ...] -> [b, s_r, ...]

Used where a module must see the whole sequence and cannot be split by heads: an opaque
attention (a ViT's, which takes hidden states and hides its q, k, v) or the splice of visual
tokens into text. Every rank then computes on the same whole sequence and keeps its slice
of the result, so the gradient of rank r's slice of the input is the sum over the group of
every rank's gradient for those positions: the backward reduce-scatters (rank r receives
the summed gradient of its own positions only).

Slices may differ in length (5 patches over 2 ranks: 3 and 2): the lengths are exchanged
first, shorter slices are padded to the longest for the all-gather, and the padding is cut
off again before anything computes on it, so no dummy token reaches a softmax.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

from ..core import comm


def slice_lengths(local_len: int, group, device) -> List[int]:
    """Every group rank's sequence length, in group-rank order."""
    sp = comm.get_world_size(group)
    bufs = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(sp)]
    comm.all_gather(bufs, torch.tensor([int(local_len)], dtype=torch.long, device=device), group=group,
                    label="sequence gather lengths")
    return [int(b.item()) for b in bufs]


def _pad_seq(x: torch.Tensor, to: int) -> torch.Tensor:
    """x padded with zeros along dim 1 to length `to`."""
    extra = to - x.shape[1]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, extra]
    return F.pad(x, pad)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, lengths):
        ctx.group, ctx.lengths = group, lengths
        sp, longest = len(lengths), max(lengths)
        padded = _pad_seq(x, longest).contiguous()
        parts = [torch.empty_like(padded) for _ in range(sp)]
        comm.all_gather(parts, padded, group=group, label="sequence gather")
        return torch.cat([p[:, :n] for p, n in zip(parts, lengths)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        group, lengths = ctx.group, ctx.lengths
        longest, rank = max(lengths), comm.get_rank(group)
        blocks = torch.split(grad, lengths, dim=1)
        stacked = torch.cat([_pad_seq(b, longest) for b in blocks], dim=1).contiguous()
        # dim 1 holds sp blocks of `longest`; reduce-scatter works on dim 0, so move it there
        front = stacked.unflatten(1, (len(lengths), longest)).movedim(1, 0).contiguous()
        out = torch.empty_like(front[0])
        comm.reduce_scatter_tensor(out, front, group=group, label="sequence gather backward")
        return out[:, :lengths[rank]], None, None


def gather_sequence(x: torch.Tensor, group) -> Tuple[torch.Tensor, List[int]]:
    """(the group's slices of x concatenated along dim 1 in group-rank order, their lengths)."""
    if x.dim() < 2:
        raise ValueError(f"gather_sequence: a tensor of {x.dim()} dims has no sequence dim 1 ([b, s, ...])")
    lengths = slice_lengths(x.shape[1], group, x.device)
    return _GatherSequence.apply(x, group, lengths), lengths


def own_slice(y: torch.Tensor, lengths: List[int], group) -> torch.Tensor:
    """This rank's positions of a whole sequence `y` laid out as gather_sequence laid it."""
    rank = comm.get_rank(group)
    start = sum(lengths[:rank])
    return y[:, start:start + lengths[rank]].contiguous()
