"""The tensor-parallel layers that replace nn.Linear / Conv1D / nn.Embedding.

Each holds only its rank's slice (cut by `local_part` from a full tensor, which may be a
memory-mapped checkpoint tensor, so only the slice is read) as a dense weight or, after
`quantize_`, as int8 values plus per-group scales. Forward is the training layers' own
(runtime/tensor_parallel/layers.py: column_linear, row_linear, vocab_lookup) with this
layer's matmul, dense or int8: row-parallel sums partial products, the vocab-parallel
embedding sums the rows each rank found, the vocab-parallel LM head gathers the logits, each
collective on the layer's group with the autograd-correct boundaries of training.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import column_linear, row_linear, vocab_lookup
from ..tensor_parallel.shard import pad_rows, take
from ..tensor_parallel.plan import LayerShard, Style, split_ranges, vocab_range
from .int8_kernel import int8_matmul
from .quantize import dequantize_int8, quantize_int8


def local_part(full: torch.Tensor, shard: Optional[LayerShard], tp: int, rank: int, which: str,
               conv1d: bool = False) -> torch.Tensor:
    """This rank's piece of a full `weight` or `bias` (Linear layout; a Conv1D weight is transposed)."""
    if which == "weight" and conv1d:
        full = full.t()
    if shard is None:
        return full
    if shard.style is Style.ROW:
        if which == "bias":
            return full  # added once, after the all-reduce
        dim = 1
    else:
        dim = 1 if shard.style is Style.HEAD_EMBEDDING else 0
    out = take(full, dim, split_ranges(shard, tp, rank))
    if shard.style in (Style.VOCAB_EMBEDDING, Style.VOCAB_HEAD):
        # the last rank's padding rows: never selected, logits trimmed
        out = pad_rows(out, vocab_range(full.shape[0], tp, rank)[2])
    return out


class _ShardedWeight(nn.Module):
    """A dense `weight` parameter, or int8 `qweight` + `scales` buffers after quantize_()."""

    def _make_weight(self, rows: int, cols: int, device, dtype) -> None:
        self.weight = nn.Parameter(torch.empty(rows, cols, device=device, dtype=dtype), requires_grad=False)
        self.compute_dtype = dtype
        self.group_size = 0  # 0: dense

    @property
    def quantized(self) -> bool:
        return self.group_size > 0

    def quantize_(self, group: int) -> None:
        q, scale = quantize_int8(self.weight.data, group)
        del self.weight
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scale.to(self.compute_dtype))
        self.group_size = group

    def share_weight_(self, other: "_ShardedWeight") -> None:
        """Use `other`'s storage (a tied LM head and token embedding)."""
        if other.quantized:
            if "weight" in self._parameters:
                del self.weight
            self.register_buffer("qweight", other.qweight)
            self.register_buffer("scales", other.scales)
            self.group_size = other.group_size
        else:
            self.weight = other.weight

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.quantized:
            y = int8_matmul(x, self.qweight, self.scales, self.group_size, self.compute_dtype)
            return y + bias if bias is not None else y
        return F.linear(x, self.weight, bias)

    def dense_weight(self) -> torch.Tensor:
        if self.quantized:
            return dequantize_int8(self.qweight, self.scales, self.compute_dtype)
        return self.weight

    def __getattr__(self, name: str):
        if name == "weight" and self.__dict__.get("group_size", 0) > 0:
            return self.dense_weight()  # read-only view for code that inspects .weight
        return super().__getattr__(name)

    def weight_bytes(self) -> int:
        if self.quantized:
            return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()
        return self.weight.numel() * self.weight.element_size()


class ParallelLinear(_ShardedWeight):
    """A Linear (or Conv1D) split per `shard`; `shard=None` keeps it whole (int8 on one rank)."""

    def __init__(self, shard: Optional[LayerShard], in_features: int, out_features: int, bias: bool, tp: int,
                 rank: int, group, conv1d: bool = False, device=None, dtype=None):
        super().__init__()
        self.shard, self.tp, self.rank, self.group = shard, tp, rank, group
        self.conv1d = conv1d  # full weights arrive as [in, out] (checkpoints of HF Conv1D layers)
        self.full_in, self.full_out = in_features, out_features
        style = shard.style if shard is not None else None
        rows, cols = out_features, in_features
        if style is Style.ROW:
            cols = in_features // tp
        elif style is Style.COLUMN:
            rows = out_features // tp
        elif style is Style.VOCAB_HEAD:
            rows = vocab_range(out_features, tp, rank)[2]
        self.in_features, self.out_features = cols, rows
        self._make_weight(rows, cols, device, dtype)
        bias_len = out_features if style is Style.ROW else rows
        self.bias = nn.Parameter(torch.empty(bias_len, device=device, dtype=dtype), requires_grad=False) \
            if bias else None

    def load_full_(self, which: str, full: torch.Tensor) -> None:
        """Copy this rank's part of the full tensor `which` ('weight' or 'bias') in."""
        target = self.weight if which == "weight" else self.bias
        target.data.copy_(local_part(full, self.shard, self.tp, self.rank, which, self.conv1d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        style = self.shard.style if self.shard is not None else None
        label = self.shard.name if self.shard is not None else "replicated"
        if style is None:
            return self.matmul(x, self.bias)
        if style is Style.ROW:
            return row_linear(x, None, self.bias, self.group, label=label, matmul=self.matmul)
        y = column_linear(x, None, self.bias, self.group, gather_output=style is Style.VOCAB_HEAD, label=label,
                          matmul=self.matmul)
        return y[..., :self.full_out] if style is Style.VOCAB_HEAD else y

    def extra_repr(self) -> str:
        style = self.shard.style.value if self.shard is not None else "replicated"
        q = f", int8 group {self.group_size}" if self.quantized else ""
        return f"{style}, in={self.in_features}, out={self.out_features}, tp={self.tp}{q}"


class ParallelEmbedding(_ShardedWeight):
    """A token embedding holding rows [start, stop) of the vocabulary (all of it when shard=None)."""

    def __init__(self, shard: Optional[LayerShard], num_embeddings: int, embedding_dim: int, tp: int, rank: int,
                 group, padding_idx: Optional[int] = None, device=None, dtype=None):
        super().__init__()
        self.shard, self.tp, self.rank, self.group = shard, tp, rank, group
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        if shard is not None:
            self.start, self.stop, rows = vocab_range(num_embeddings, tp, rank)
        else:
            self.start, self.stop, rows = 0, num_embeddings, num_embeddings
        self._make_weight(rows, embedding_dim, device, dtype)

    def load_full_(self, which: str, full: torch.Tensor) -> None:
        self.weight.data.copy_(local_part(full, self.shard, self.tp, self.rank, which))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            q = self.qweight[ids]
            s = self.scales[ids].to(self.compute_dtype)
            groups = s.shape[-1]
            return (q.reshape(*ids.shape, groups, -1).to(self.compute_dtype) * s.unsqueeze(-1)).reshape(
                *ids.shape, self.embedding_dim)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return self._rows(ids)
        return vocab_lookup(ids, self.start, self.stop, self._rows, self.group, self.shard.name)

    def extra_repr(self) -> str:
        style = "vocab-parallel" if self.shard is not None else "replicated"
        q = f", int8 group {self.group_size}" if self.quantized else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, {style} rows [{self.start}, {self.stop}){q}"
