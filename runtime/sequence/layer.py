"""DeepSpeed's DistributedAttention (`deepspeed.sequence.layer.DistributedAttention`).

    attn = DistributedAttention(local_attention, mesh.group("sequence"))
    out = attn(q, k, v, batch_dim_idx)     # q, k, v: this rank's slice of the sequence

Each rank passes its slice of the sequence with every head; the wrapper exchanges it for
the whole sequence of a share of the heads, runs `local_attention(q, k, v, *args,
**kwargs)` on that (a causal mask sees every position), and exchanges the result back.
Layouts: batch_dim_idx=1 is Megatron's [s, b, h, d], batch_dim_idx=0 batch-first
[b, s, h, d]; heads are dim 2 in both. The head split follows the key/value heads
(heads.py), so uneven head counts and grouped-query attention work unchanged: the local
attention gets q with H_r * (Hq / Hkv) heads and k, v with the matching H_r heads.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

# _SeqAllToAll: DeepSpeed keeps its exchange in this module, where scripts import it from
from .all_to_all import _SeqAllToAll, heads_to_sequence, sequence_to_heads  # noqa: F401
from .heads import SequenceParallelError
from .rotary import _rotate_half, _torchembed_available, apply_rotary_pos_emb  # noqa: F401  (DeepSpeed keeps them here)


class DistributedAttention(torch.nn.Module):
    """local_attention: a callable (q, k, v, *args, **kwargs) -> context in q's layout.
    sequence_process_group: the sequence axis's group (`mesh.group("sequence")`).
    scatter_idx: the head dim (2, DeepSpeed's default and only layout with heads third).
    gather_idx: the sequence dim of DeepSpeed's layout (0 or 1); the dim actually used is
    the one of 0 and 1 that forward's batch_dim_idx does not name, as in DeepSpeed.
    num_kv_heads: the key/value head count the split follows (default: key's head count)."""

    def __init__(self, local_attention, sequence_process_group, scatter_idx: int = 2, gather_idx: int = 0,
                 sp_stream=None, num_kv_heads: Optional[int] = None) -> None:
        super().__init__()
        if scatter_idx != 2:
            raise SequenceParallelError(f"DistributedAttention: scatter_idx {scatter_idx} is not supported; heads "
                                        "must be dim 2 ([s, b, h, d] or [b, s, h, d])")
        if gather_idx not in (0, 1):
            raise SequenceParallelError(f"DistributedAttention: gather_idx {gather_idx} must be 0 or 1 (the sequence "
                                        "dim)")
        if sp_stream is not None:
            raise SequenceParallelError("DistributedAttention: sp_stream (all-to-alls overlapped on a side stream) "
                                        "is not supported; pass sp_stream=None")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.num_kv_heads = num_kv_heads

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if batch_dim_idx not in (0, 1):
            raise SequenceParallelError(f"DistributedAttention: batch_dim_idx {batch_dim_idx} must be 0 "
                                        "([b, s, h, d]) or 1 ([s, b, h, d])")
        if rotary_pos_emb is not None:
            raise SequenceParallelError("DistributedAttention: rotary_pos_emb is not supported; apply rotary "
                                        "embeddings inside local_attention (it sees whole-sequence positions)")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4:
                raise SequenceParallelError(f"DistributedAttention: {name} has {t.dim()} dims; expected 4 "
                                            "([s, b, h, d] or [b, s, h, d])")
        if key.shape[2] != value.shape[2]:
            raise SequenceParallelError(f"DistributedAttention: key has {key.shape[2]} heads but value "
                                        f"{value.shape[2]}")
        seq_dim = 1 - batch_dim_idx
        kv = self.num_kv_heads if self.num_kv_heads is not None else key.shape[2]
        if key.shape[2] != kv:
            raise SequenceParallelError(f"DistributedAttention: num_kv_heads {kv} but key has {key.shape[2]} heads")
        q = sequence_to_heads(query, self.spg, seq_dim, kv_heads=kv)
        k = sequence_to_heads(key, self.spg, seq_dim, kv_heads=kv)
        v = sequence_to_heads(value, self.spg, seq_dim, kv_heads=kv)
        context = self.local_attn(q, k, v, *args, **kwargs)
        if context.dim() != 4 or context.shape[2] != q.shape[2]:
            raise SequenceParallelError(f"DistributedAttention: local_attention returned shape "
                                        f"{tuple(context.shape)}; expected q's layout {tuple(q.shape)}")
        return heads_to_sequence(context, self.spg, seq_dim, total_heads=query.shape[2], kv_heads=kv)
