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


def _local_head_counts(y: torch.Tensor, group, head_dim: int) -> List[int]:
    """Every rank's head count, in rank order: the splits of a heads->sequence exchange whose
    total the caller does not give (DeepSpeed's _SeqAllToAll takes none)."""
    sp, _ = _place(group)
    mine = torch.tensor([y.shape[head_dim]], dtype=torch.int64, device=y.device)
    counts = torch.empty(sp, dtype=torch.int64, device=y.device)
    comm.all_gather_into_tensor(counts, mine, group=group, label="ulysses head counts")
    return [int(c) for c in counts.tolist()]


class _SeqAllToAll:
    """DeepSpeed's `deepspeed.sequence.layer._SeqAllToAll`, the exchange its Ulysses layers and
    scripts call directly:

        _SeqAllToAll.apply(group, x, scatter_idx, gather_idx, batch_dim_idx)

    scatter_idx 2 (heads) sends this rank's sequence slice of every head and returns the whole
    sequence of its share of the heads; scatter_idx 0 or 1 is the way back. As in DeepSpeed the
    sequence dim is the one of 0 and 1 that batch_dim_idx does not name, and an uneven head
    count splits as AutoTP's shard sizes do (heads.head_splits). Differentiable: the backward of
    one direction is the other. The way back learns the split from the ranks' head counts (one
    small all-gather), where DeepSpeed reads a head count kept from an earlier call.
    DeepSpeed's overlapped variant (a stream and a handle dict filled with pending work) is
    refused: exchanges here are synchronous."""

    @staticmethod
    def apply(group, input: torch.Tensor, scatter_idx: int, gather_idx: int, batch_dim_idx: int, stream=None,
              handle=None, type=None, is_fwd: bool = True) -> torch.Tensor:
        if stream is not None or handle is not None:
            raise SequenceParallelError("_SeqAllToAll: the overlapped all-to-all (stream, handle) is not supported; "
                                        "call it with stream=None and handle=None")
        if batch_dim_idx not in (0, 1):
            raise SequenceParallelError(f"_SeqAllToAll: batch_dim_idx {batch_dim_idx} must be 0 ([b, s, h, d]) or 1 "
                                        "([s, b, h, d])")
        if input.dim() != 4:
            raise SequenceParallelError(f"_SeqAllToAll: the input has {input.dim()} dims; expected 4 ([s, b, h, d] "
                                        "or [b, s, h, d])")
        if 2 not in (scatter_idx, gather_idx) or not {scatter_idx, gather_idx} - {2} <= {0, 1}:
            raise SequenceParallelError(f"_SeqAllToAll: scatter_idx {scatter_idx} and gather_idx {gather_idx}: one "
                                        "must be the head dim 2 and the other a sequence dim (0 or 1)")
        seq_dim = 1 - batch_dim_idx
        if scatter_idx == 2:
            return sequence_to_heads(input, group, seq_dim)
        sp, _ = _place(group)
        if sp == 1:
            return input
        if input.shape[seq_dim] % sp:
            raise SequenceParallelError(f"_SeqAllToAll: sequence length {input.shape[seq_dim]} does not split evenly "
                                        f"over sequence parallel size {sp}")
        return _HeadsToSequence.apply(input, group, seq_dim, 2, _local_head_counts(input, group, 2))
