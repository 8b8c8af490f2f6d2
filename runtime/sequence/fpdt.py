"""FPDT's load-balanced input layout (`deepspeed.sequence.fpdt_layer`).

FPDT (fully pipelined distributed transformer) cuts a causal sequence into chunks and deals
them out round-robin, so every rank holds early and late tokens and the causal attention work
is balanced: with `s` ranks and `n` chunks per rank, rank `r` holds chunks r, r+s, ..., r+(n-1)s
of the global sequence, in that order.

`FPDT_InputConstruct` is that layout, as DeepSpeed's class: `generate()` returns this rank's
(tokens, labels, loss_mask, attention_mask, position_ids). FPDT's attention kernels (chunked
flash attention with host offloading, DeepSpeed's `_FPDTGPUAttentionImpl_`,
`_FPDTGPUOffloadingAttentionImpl_`, `FPDT_Attention`) need flash-attn on CUDA and are not
provided: calling them is one error naming DistributedAttention (runtime/sequence/layer.py),
the Ulysses attention dslaunch runs.
"""
from __future__ import annotations

from typing import List

import torch

_NO_KERNEL = ("FPDT's chunked flash attention ({name}) is not provided by dslaunch (DeepSpeed runs it with "
              "flash-attn on CUDA only); use deepspeed.sequence.layer.DistributedAttention for sequence parallelism")


class FPDTLayoutError(ValueError):
    """Sizes that cannot be dealt out in whole chunks."""


def chunk_order(num_chunks_per_rank: int, sp_size: int) -> List[int]:
    """The global chunk ids in layout order: rank 0's chunks, then rank 1's, ..."""
    return [rank + k * sp_size for rank in range(sp_size) for k in range(num_chunks_per_rank)]


class FPDT_InputConstruct(torch.nn.Module):
    """This rank's share of a batch in FPDT's layout. `args.ds_sequence_parallel_fpdt_chunk_size`
    tokens of the global sequence are one chunk *per rank group*: each rank's chunks are
    chunk_size / sp_size tokens long. Sequences are dimension 1 of every tensor."""

    def __init__(self, tokens, labels, loss_mask, attention_mask, position_ids, args, sp_size, sp_rank) -> None:
        super().__init__()
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        seq_len = tokens.shape[1]
        fpdt_chunk = args.ds_sequence_parallel_fpdt_chunk_size
        if seq_len % sp_size or seq_len % fpdt_chunk:
            raise FPDTLayoutError(f"FPDT_InputConstruct: sequence length {seq_len} must divide by the sequence "
                                  f"parallel size {sp_size} and by ds_sequence_parallel_fpdt_chunk_size {fpdt_chunk}")
        per_rank = seq_len // fpdt_chunk  # chunks each rank holds
        local = seq_len // sp_size
        if local % per_rank:
            raise FPDTLayoutError(f"FPDT_InputConstruct: {local} tokens per rank do not cut into {per_rank} chunks")
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.num_chunk_per_gpu = per_rank
        self.chunk_size = local // per_rank
        self.global_seq_len, self.local_seq_len = seq_len, local
        self.batch_size = tokens.shape[0]
        self.device = tokens.device

    def _positions(self) -> torch.Tensor:
        """The global token positions in layout order (every rank's share, rank by rank)."""
        chunks = torch.tensor(chunk_order(self.num_chunk_per_gpu, self.sp_size), device=self.device)
        within = torch.arange(self.chunk_size, device=self.device)
        return (chunks[:, None] * self.chunk_size + within[None, :]).flatten()

    def generate(self):
        order = self._positions()
        mine = order[self.sp_rank * self.local_seq_len:(self.sp_rank + 1) * self.local_seq_len]
        take = (lambda t, index: None if t is None else t[:, index])
        # DeepSpeed 0.19.8 hands back the loss mask of the whole sequence in layout order (not
        # this rank's share) and the attention mask untouched; kept, since callers index them so
        return (take(self.tokens, mine), take(self.labels, mine), take(self.loss_mask, order), self.attention_mask,
                take(self.position_ids, mine))


class _RefusedKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):
        raise NotImplementedError(_NO_KERNEL.format(name=ctx.__class__.__name__.replace("Backward", "")))

    @staticmethod
    def backward(ctx, *grads):  # pragma: no cover - forward always raises
        raise NotImplementedError


class _FPDTGPUAttentionImpl_(_RefusedKernel):
    pass


class _FPDTGPUOffloadingAttentionImpl_(_RefusedKernel):
    pass


class FPDT_Attention(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_NO_KERNEL.format(name="FPDT_Attention"))
