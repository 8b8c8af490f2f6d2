"""The two Ulysses exchanges over a sequence group, with autograd.

    sequence_to_heads(x, group, seq_dim)   [.., s/p, .., H, d] -> [.., s, .., H_r, d]
    heads_to_sequence(y, group, seq_dim, total_heads)   the way back

`seq_dim` is where the sequence sits (0 for Megatron's [s, b, h, d], 1 for batch-first
[b, s, h, d]); heads sit at `head_dim` (2 in both). H_r is rank r's share of the heads
(heads.head_splits: uneven counts and grouped-query attention), so the all-to-all carries
uneven splits. An all-to-all only moves elements, so each exchange's backward is the other
exchange applied to the gradient, over the same group with the same splits.

Every exchange goes through dslaunch.runtime.comm on the group it is given (the mesh's
`sequence` axis), never the world.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..core import comm
from .heads import SequenceParallelError, head_splits


def _place(group):
    return comm.get_world_size(group), comm.get_rank(group)


def _sizes(out_splits: List[int], in_splits: List[int]):
    """(output_split_sizes, input_split_sizes): None for both when the heads split evenly (the
    even all-to-all, which same-host groups run through shared memory), else the lists.
    `splits` is the same on every rank, so every rank of the group makes the same choice."""
    if len(set(out_splits)) == 1 and len(set(in_splits)) == 1:
        return None, None
    return list(out_splits), list(in_splits)


def _seq_in_rest(seq_dim: int, head_dim: int) -> int:
    """Where the sequence is once the head dimension has been moved to the front."""
    return seq_dim if seq_dim < head_dim else seq_dim - 1


def _to_heads(x: torch.Tensor, group, seq_dim: int, head_dim: int, splits: List[int]) -> torch.Tensor:
    sp, rank = _place(group)
    mine = splits[rank]
    front = x.movedim(head_dim, 0).contiguous()  # [H, *rest], rest holding s/p
    rest = front.shape[1:]
    out = torch.empty((sp * mine, *rest), dtype=x.dtype, device=x.device)
    comm.all_to_all_single(out, front, *_sizes([mine] * sp, splits), group=group, label="ulysses sequence->heads")
    s = _seq_in_rest(seq_dim, head_dim)
    # block j came from sequence rank j: its slice of the sequence, for this rank's heads
    y = out.view(sp, mine, *rest).movedim(0, 1 + s).flatten(1 + s, 2 + s)
    return y.movedim(0, head_dim).contiguous()


def _to_sequence(y: torch.Tensor, group, seq_dim: int, head_dim: int, splits: List[int]) -> torch.Tensor:
    sp, rank = _place(group)
    mine = y.shape[head_dim]
    front = y.movedim(head_dim, 0)  # [H_r, *rest], rest holding s
    s = _seq_in_rest(seq_dim, head_dim)
    full = front.shape[1 + s]
    blocks = front.unflatten(1 + s, (sp, full // sp)).movedim(1 + s, 0).contiguous()  # [sp, H_r, *rest(s/p)]
    rest = blocks.shape[2:]
    out = torch.empty((sum(splits), *rest), dtype=y.dtype, device=y.device)
    comm.all_to_all_single(out, blocks.flatten(0, 1), *_sizes(splits, [mine] * sp), group=group,
                           label="ulysses heads->sequence")
    return out.movedim(0, head_dim).contiguous()


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, seq_dim, head_dim, splits):
        ctx.args = (group, seq_dim, head_dim, splits)
        return _to_heads(x, group, seq_dim, head_dim, splits)

    @staticmethod
    def backward(ctx, grad):
        return (_HeadsToSequence.apply(grad.contiguous(), *ctx.args), None, None, None, None)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, seq_dim, head_dim, splits):
        ctx.args = (group, seq_dim, head_dim, splits)
        return _to_sequence(y, group, seq_dim, head_dim, splits)

    @staticmethod
    def backward(ctx, grad):
        return (_SequenceToHeads.apply(grad.contiguous(), *ctx.args), None, None, None, None)


def sequence_to_heads(x: torch.Tensor, group, seq_dim: int, head_dim: int = 2,
                      kv_heads: Optional[int] = None) -> torch.Tensor:
    """This rank's sequence slice of every head -> the whole sequence of its share of the
    heads. `kv_heads`: the model's key/value head count when `x` holds query heads under
    grouped-query attention (the split follows it)."""
    sp, _ = _place(group)
    if sp == 1:
        return x
    _check_dims(x, seq_dim, head_dim)
    splits = head_splits(x.shape[head_dim], sp, kv_heads)
    return _SequenceToHeads.apply(x, group, seq_dim, head_dim, splits)


def heads_to_sequence(y: torch.Tensor, group, seq_dim: int, total_heads: int, head_dim: int = 2,
                      kv_heads: Optional[int] = None) -> torch.Tensor:
    """The inverse of sequence_to_heads for a tensor that had `total_heads` heads."""
    sp, rank = _place(group)
    if sp == 1:
        return y
    _check_dims(y, seq_dim, head_dim)
    splits = head_splits(total_heads, sp, kv_heads)
    if y.shape[head_dim] != splits[rank]:
        raise SequenceParallelError(f"sequence rank {rank} holds {y.shape[head_dim]} heads but its share of "
                                    f"{total_heads} is {splits[rank]}")
    if y.shape[seq_dim] % sp:
        raise SequenceParallelError(f"sequence length {y.shape[seq_dim]} does not split evenly over sequence "
                                    f"parallel size {sp}")
    return _HeadsToSequence.apply(y, group, seq_dim, head_dim, splits)


def _check_dims(x: torch.Tensor, seq_dim: int, head_dim: int) -> None:
    if seq_dim == head_dim or not (0 <= seq_dim < x.dim() and 0 <= head_dim < x.dim()):
        raise SequenceParallelError(f"sequence dim {seq_dim} and head dim {head_dim} must be two different dims "
                                    f"of a {x.dim()}-d tensor")
