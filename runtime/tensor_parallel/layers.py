"""Trainable tensor-parallel layers: column-, row- and vocab-parallel, on an explicit group.

Each layer is given its group, the group's size and this rank's place in it (never the
world), holds only its rank's slice as an ordinary trainable Parameter, and brackets its
matmul with the region boundaries of collectives.py, so forward and backward both equal a
single process's layer:

    ColumnParallelLinear   y_local = x W_local^T + b_local       copy_to_region on x;
                           gather_output=True all-gathers y (vocabulary or any output)
    RowParallelLinear      y = sum_r x_r W_r^T + b               reduce_from_region, then the
                           (replicated) bias; input_is_parallel=False splits x first
    VocabParallelEmbedding rows [start, stop) of the table      masked lookup, reduce_from_region
    VocabParallelLMHead    logits over rows [start, stop)        copy_to_region on the hidden
                           state; gathered and trimmed to the vocabulary, or left local for
                           vocab_parallel_cross_entropy

`from_linear` / `from_embedding` cut this rank's slice out of a full nn.Linear, Hugging Face
Conv1D or nn.Embedding (shard.py's maths: fused outputs part by part, a padded vocabulary).
Every layer describes how its parameters map back onto the full ones (`param_shards`), which
`full_state_dict` uses to reassemble the unsharded tensors (tests, consolidation).

The functional forms (column_linear, row_linear, vocab_lookup) are what the inference layers
(runtime/inference/layers.py) run too, so there is one implementation of each parallel forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core import comm
from .collectives import all_reduce_max_, copy_to_region, gather_last_dim, reduce_from_region, split_last_dim
from .shard import TensorParallelError, linear_shape, pad_rows, part_ranges, take, vocab_range


# ---------------------------------------------------------------- functional forms

def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any,
                  gather_output: bool = False, label: str = "column", matmul: Optional[Callable] = None
                  ) -> torch.Tensor:
    """This rank's output columns of x W^T + b (all of them with gather_output)."""
    x = copy_to_region(x, group, f"tp {label} input grad")
    y = matmul(x, bias) if matmul is not None else F.linear(x, weight, bias)
    return gather_last_dim(y, group, f"tp {label} gather output") if gather_output else y


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any,
               input_is_parallel: bool = True, label: str = "row", matmul: Optional[Callable] = None
               ) -> torch.Tensor:
    """x W^T + b, W split along its input columns: partial products summed over the group."""
    if not input_is_parallel:
        x = split_last_dim(x, group, f"tp {label} split input")
    y = matmul(x, None) if matmul is not None else F.linear(x, weight)
    y = reduce_from_region(y, group, f"tp {label} sum")
    return y + bias if bias is not None else y


def vocab_lookup(ids: torch.Tensor, start: int, stop: int, rows: Callable[[torch.Tensor], torch.Tensor], group: Any,
                 label: str = "embedding") -> torch.Tensor:
    """Embedding rows of `ids` from tables split by vocabulary: each rank looks up the ids in
    [start, stop) (`rows` maps local ids to vectors), zeroes the rest, and the sum is replicated."""
    mine = (ids >= start) & (ids < stop)
    out = rows(torch.where(mine, ids - start, torch.zeros_like(ids)))
    out = out * mine.unsqueeze(-1).to(out.dtype)
    return reduce_from_region(out, group, f"tp {label} sum")


# ---------------------------------------------------------------- how a shard maps onto the full tensor

@dataclass(frozen=True)
class ParamShard:
    """A local parameter's place in the full one: split along `dim` into `parts` (widths, each
    split evenly), or by vocabulary blocks (`vocab`: full rows, the local tensor padded), or
    into one block per rank of the widths `sizes` (in rank order: DeepSpeed's uneven AutoTP
    split), or into stacked sub-parameters each split over the ranks at its own widths
    (`sub_widths`: one rank-ordered list per sub-parameter, a width may be 0; DeepSpeed's fused
    and SubParam layers), or replicated (`dim` None). `conv1d`: the full tensor is stored
    transposed (HF Conv1D)."""

    dim: Optional[int]
    full: int = 0
    parts: Tuple[int, ...] = ()
    vocab: bool = False
    conv1d: bool = False
    sizes: Tuple[int, ...] = ()
    sub_widths: Tuple[Tuple[int, ...], ...] = ()  # per sub-parameter, each rank's width (may be 0)

    def ranges(self, tp: int, rank: int) -> List[Tuple[int, int]]:
        if self.sub_widths:  # one piece of each sub-parameter (DeepSpeed's SubParam layers)
            out, offset = [], 0
            for per_rank in self.sub_widths:
                start = offset + sum(per_rank[:rank])
                out.append((start, start + per_rank[rank]))
                offset += sum(per_rank)
            return out
        if self.sizes:
            start = sum(self.sizes[:rank])
            return [(start, start + self.sizes[rank])]
        if self.vocab:
            start, stop, _ = vocab_range(self.full, tp, rank)
            return [(start, stop)]
        return part_ranges(self.parts or (self.full,), tp, rank)

    def cut(self, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """This rank's local tensor from the full one (in the full tensor's own layout)."""
        if self.conv1d and full.dim() == 2:
            full = full.t()
        if self.dim is None:
            return full
        local = take(full, self.dim, self.ranges(tp, rank))
        if self.vocab:
            local = pad_rows(local, vocab_range(self.full, tp, rank)[2])
        return local

    def assemble(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's local tensor (in rank order)."""
        if self.dim is None:
            full = locals_[0]
        else:
            tp = len(locals_)
            shape = list(locals_[0].shape)
            shape[self.dim] = self.full
            full = locals_[0].new_empty(shape)
            for rank, local in enumerate(locals_):
                offset = 0
                for a, b in self.ranges(tp, rank):
                    full.narrow(self.dim, a, b - a).copy_(local.narrow(self.dim, offset, b - a))
                    offset += b - a
        return full.t().contiguous() if self.conv1d and full.dim() == 2 else full


class TensorParallelLayer(nn.Module):
    """What every parallel layer holds: its group (None: tp 1, this process alone), the group's
    size, this rank, a label for its collectives (autotp sets the module path), and how its
    parameters map to full ones."""

    def _setup(self, group: Any, tp_size: int, tp_rank: int, label: Optional[str]) -> None:
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise TensorParallelError(f"tensor parallel: rank {tp_rank} is not in a group of {tp_size}")
        self.group, self.tp_size, self.tp_rank = group, tp_size, tp_rank
        self.label = label or type(self).__name__
        self.shards: Dict[str, ParamShard] = {}

    def _check_group(self) -> None:
        """After the shapes were checked: the group must have tp_size ranks."""
        if self.tp_size > 1:
            group = self.group
            size = comm.get_world_size(group) if group is not None and comm.is_initialized() else 1
            if size != self.tp_size:
                raise TensorParallelError(f"tensor parallel: tp_size {self.tp_size} but the group given has {size} "
                                          f"rank{'s' if size != 1 else ''}")

    def _mark_shards(self) -> None:
        """Tag every split parameter as DeepSpeed/Megatron do (`tensor_model_parallel`, and its
        `partition_dim`), so gradient norms sum shards over the group and count replicated
        parameters (a row layer's bias) once."""
        for name, spec in self.shards.items():
            param = getattr(self, name)
            param.tensor_model_parallel = spec.dim is not None and self.tp_size > 1
            param.partition_dim = spec.dim

    def param_shards(self) -> Dict[str, ParamShard]:
        return dict(self.shards)

    def load_full_(self, name: str, full: torch.Tensor) -> None:
        """Copy this rank's slice of the full parameter `name` in."""
        with torch.no_grad():
            getattr(self, name).copy_(self.shards[name].cut(full, self.tp_size, self.tp_rank))


def is_tensor_parallel_shard(param: torch.Tensor) -> bool:
    """True for a parameter a tensor-parallel layer split over its group (its gradient norm is
    summed over the group); False for a replicated one (counted once)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _new(shape, device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


def _check_even(size: int, tp: int, what: str) -> None:
    if size % tp:
        raise TensorParallelError(f"tensor parallel: tp size {tp} does not divide {what} ({size})")


class ColumnParallelLinear(TensorParallelLayer):
    """nn.Linear with its output features split over the group (Megatron's column parallel).

    `parts`: the widths of a fused output ([q|k|v]: three widths, unequal for grouped-query
    heads), each split evenly, so the local output is [q_r|k_r|v_r]. With gather_output the
    full output is all-gathered (a single part only)."""

    def __init__(self, in_features: int, out_features: int, group: Any, tp_size: int, tp_rank: int,
                 bias: bool = True, gather_output: bool = False, parts: Optional[Sequence[int]] = None,
                 device=None, dtype=None, label: Optional[str] = None, conv1d: bool = False):
        super().__init__()
        self._setup(group, tp_size, tp_rank, label)
        parts = tuple(int(p) for p in parts) if parts else (out_features,)
        if sum(parts) != out_features:
            raise TensorParallelError(f"tensor parallel: parts {list(parts)} do not add up to {out_features} "
                                      f"output features ({self.label})")
        for p in parts:
            _check_even(p, tp_size, f"the output features of {self.label}")
        if gather_output and len(parts) > 1:
            raise TensorParallelError(f"tensor parallel: gather_output needs an unfused output ({self.label})")
        self.in_features, self.full_out_features = in_features, out_features
        self.out_features = out_features // tp_size
        self.gather_output, self.parts = gather_output, parts
        self._check_group()
        self.weight = _new((self.out_features, in_features), device, dtype)
        self.bias = _new((self.out_features,), device, dtype) if bias else None
        self.shards["weight"] = ParamShard(0, out_features, parts if len(parts) > 1 else (), conv1d=conv1d)
        if bias:
            self.shards["bias"] = ParamShard(0, out_features, parts if len(parts) > 1 else ())
        self._mark_shards()

    @classmethod
    def from_linear(cls, module: nn.Module, group: Any, tp_size: int, tp_rank: int, gather_output: bool = False,
                    parts: Optional[Sequence[int]] = None, label: Optional[str] = None) -> "ColumnParallelLinear":
        """This rank's columns of a full nn.Linear or HF Conv1D."""
        fin, fout, conv1d = _shape_of(module)
        new = cls(fin, fout, group, tp_size, tp_rank, bias=getattr(module, "bias", None) is not None,
                  gather_output=gather_output, parts=parts, device=module.weight.device, dtype=module.weight.dtype,
                  label=label, conv1d=conv1d)
        _copy_from(new, module)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.bias, self.group, self.gather_output, self.label)

    def extra_repr(self) -> str:
        fused = f", parts={list(self.parts)}" if len(self.parts) > 1 else ""
        return (f"in={self.in_features}, out={self.out_features} of {self.full_out_features}, tp={self.tp_size}, "
                f"gather_output={self.gather_output}{fused}")


class RowParallelLinear(TensorParallelLayer):
    """nn.Linear with its input features split over the group (Megatron's row parallel); the
    bias is whole and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, group: Any, tp_size: int, tp_rank: int,
                 bias: bool = True, input_is_parallel: bool = True, device=None, dtype=None,
                 label: Optional[str] = None, conv1d: bool = False):
        super().__init__()
        self._setup(group, tp_size, tp_rank, label)
        _check_even(in_features, tp_size, f"the input features of {self.label}")
        self.full_in_features, self.out_features = in_features, out_features
        self.in_features = in_features // tp_size
        self.input_is_parallel = input_is_parallel
        self._check_group()
        self.weight = _new((out_features, self.in_features), device, dtype)
        self.bias = _new((out_features,), device, dtype) if bias else None
        self.shards["weight"] = ParamShard(1, in_features, conv1d=conv1d)
        if bias:
            self.shards["bias"] = ParamShard(None)
        self._mark_shards()

    @classmethod
    def from_linear(cls, module: nn.Module, group: Any, tp_size: int, tp_rank: int, input_is_parallel: bool = True,
                    label: Optional[str] = None) -> "RowParallelLinear":
        fin, fout, conv1d = _shape_of(module)
        new = cls(fin, fout, group, tp_size, tp_rank, bias=getattr(module, "bias", None) is not None,
                  input_is_parallel=input_is_parallel, device=module.weight.device, dtype=module.weight.dtype,
                  label=label, conv1d=conv1d)
        _copy_from(new, module)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self.weight, self.bias, self.group, self.input_is_parallel, self.label)

    def extra_repr(self) -> str:
        return (f"in={self.in_features} of {self.full_in_features}, out={self.out_features}, tp={self.tp_size}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(TensorParallelLayer):
    """nn.Embedding whose rows (the vocabulary) are split over the group, ceil(vocab/tp) rows
    per rank (the last rank's extra rows are padding no id selects)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, tp_size: int, tp_rank: int,
                 padding_idx: Optional[int] = None, device=None, dtype=None, label: Optional[str] = None):
        super().__init__()
        self._setup(group, tp_size, tp_rank, label)
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.start, self.stop, rows = vocab_range(num_embeddings, tp_size, tp_rank)
        self.local_padding_idx = padding_idx - self.start \
            if padding_idx is not None and self.start <= padding_idx < self.stop else None
        self._check_group()
        self.weight = _new((rows, embedding_dim), device, dtype)
        self.shards["weight"] = ParamShard(0, num_embeddings, vocab=True)
        self._mark_shards()

    @classmethod
    def from_embedding(cls, module: nn.Embedding, group: Any, tp_size: int, tp_rank: int,
                       label: Optional[str] = None) -> "VocabParallelEmbedding":
        if module.max_norm is not None or module.sparse:
            raise TensorParallelError(f"tensor parallel: {label or 'an embedding'} uses max_norm/sparse, which a "
                                      "vocab-parallel embedding does not support")
        new = cls(module.num_embeddings, module.embedding_dim, group, tp_size, tp_rank, module.padding_idx,
                  device=module.weight.device, dtype=module.weight.dtype, label=label)
        new.load_full_("weight", module.weight.detach())
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_lookup(ids, self.start, self.stop,
                            lambda local: F.embedding(local, self.weight, self.local_padding_idx), self.group,
                            self.label)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.stop}), tp={self.tp_size}"


class HeadParallelEmbedding(TensorParallelLayer):
    """An embedding with one column per attention head (T5's relative position bias), its
    columns split with the heads: each rank looks up its own heads' values, no collective."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Any, tp_size: int, tp_rank: int,
                 device=None, dtype=None, label: Optional[str] = None):
        super().__init__()
        self._setup(group, tp_size, tp_rank, label)
        _check_even(embedding_dim, tp_size, f"the heads of {self.label}")
        self.num_embeddings, self.full_embedding_dim = num_embeddings, embedding_dim
        self.embedding_dim = embedding_dim // tp_size
        self._check_group()
        self.weight = _new((num_embeddings, self.embedding_dim), device, dtype)
        self.shards["weight"] = ParamShard(1, embedding_dim)
        self._mark_shards()

    @classmethod
    def from_embedding(cls, module: nn.Embedding, group: Any, tp_size: int, tp_rank: int,
                       label: Optional[str] = None) -> "HeadParallelEmbedding":
        new = cls(module.num_embeddings, module.embedding_dim, group, tp_size, tp_rank, device=module.weight.device,
                  dtype=module.weight.dtype, label=label)
        new.load_full_("weight", module.weight.detach())
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} of {self.full_embedding_dim} heads, tp={self.tp_size}"


class VocabParallelLMHead(TensorParallelLayer):
    """The output projection over the vocabulary, rows split as VocabParallelEmbedding's (so
    a tied head shares the embedding's local weight). gather_output=True returns the full
    logits; False returns this rank's columns for vocab_parallel_cross_entropy."""

    def __init__(self, in_features: int, vocab_size: int, group: Any, tp_size: int, tp_rank: int,
                 bias: bool = False, gather_output: bool = True, device=None, dtype=None,
                 label: Optional[str] = None):
        super().__init__()
        self._setup(group, tp_size, tp_rank, label)
        self.in_features, self.vocab_size, self.gather_output = in_features, vocab_size, gather_output
        self.start, self.stop, rows = vocab_range(vocab_size, tp_size, tp_rank)
        self._check_group()
        self.weight = _new((rows, in_features), device, dtype)
        self.bias = _new((rows,), device, dtype) if bias else None
        self.shards["weight"] = ParamShard(0, vocab_size, vocab=True)
        if bias:
            self.shards["bias"] = ParamShard(0, vocab_size, vocab=True)
        self._mark_shards()

    @classmethod
    def from_linear(cls, module: nn.Linear, group: Any, tp_size: int, tp_rank: int, gather_output: bool = True,
                    label: Optional[str] = None) -> "VocabParallelLMHead":
        fin, fout, conv1d = _shape_of(module)
        if conv1d:
            raise TensorParallelError(f"tensor parallel: {label or 'the LM head'} is a Conv1D; a vocab-parallel "
                                      "head needs an nn.Linear")
        new = cls(fin, fout, group, tp_size, tp_rank, bias=module.bias is not None, gather_output=gather_output,
                  device=module.weight.device, dtype=module.weight.dtype, label=label)
        _copy_from(new, module)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_linear(x, self.weight, self.bias, self.group, self.gather_output, self.label)
        return y[..., :self.vocab_size] if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, vocab rows [{self.start}, {self.stop}) of {self.vocab_size}, "
                f"tp={self.tp_size}, gather_output={self.gather_output}")


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, target: torch.Tensor, group: Any, vocab_start: int,
                                 vocab_stop: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy from logits split by vocabulary (a VocabParallelLMHead with
    gather_output=False), without gathering them: the max, the sum of exponentials and the
    target's logit are reduced over the group. Ignored targets give 0. Every rank returns the
    same losses; gradients reach only this rank's columns."""
    logits = local_logits.float()
    valid = vocab_stop - vocab_start
    if valid < logits.shape[-1]:  # the last rank's padding columns
        pad = torch.arange(logits.shape[-1], device=logits.device) >= valid
        logits = logits.masked_fill(pad, float("-inf"))
    peak = logits.detach().max(dim=-1).values
    all_reduce_max_(peak, group, "tp cross-entropy max")
    shifted = logits - peak.unsqueeze(-1)
    sum_exp = reduce_from_region(shifted.exp().sum(dim=-1), group, "tp cross-entropy sum exp")
    mine = (target >= vocab_start) & (target < vocab_stop)
    local_target = torch.where(mine, target - vocab_start, torch.zeros_like(target))
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine.to(shifted.dtype)
    picked = reduce_from_region(picked, group, "tp cross-entropy target logit")
    loss = torch.log(sum_exp) - picked
    return torch.where(target == ignore_index, torch.zeros_like(loss), loss)


# ---------------------------------------------------------------- helpers

def _shape_of(module: nn.Module) -> Tuple[int, int, bool]:
    shape = linear_shape(module)
    if shape is None:
        raise TensorParallelError(f"tensor parallel: {type(module).__name__} is not an nn.Linear or Conv1D")
    return shape


def _copy_from(new: TensorParallelLayer, module: nn.Module) -> None:
    new.load_full_("weight", module.weight.detach())
    if getattr(module, "bias", None) is not None:
        new.load_full_("bias", module.bias.detach())


def gather_uneven(local: torch.Tensor, dim: int, sizes: Sequence[int], group: Any, label: str) -> torch.Tensor:
    """The full tensor from every rank's block along `dim`, the blocks `sizes` wide in rank order
    (unequal allowed): each block is zero-padded to the widest so one all-gather of equal
    tensors carries them, then trimmed. Collective over `group`; not differentiable."""
    widest = max(sizes)
    local = local.detach().contiguous()
    if local.shape[dim] != widest:
        pad = list(local.shape)
        pad[dim] = widest - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad)], dim)
    gathered = torch.empty((len(sizes),) + tuple(local.shape), dtype=local.dtype, device=local.device)
    comm.all_gather_into_tensor(gathered, local.unsqueeze(0), group=group, label=label)
    return torch.cat([block.narrow(dim, 0, width) for block, width in zip(gathered.unbind(0), sizes)], dim)


def gather_parts_uneven(local: torch.Tensor, dim: int, part_sizes: Sequence[Sequence[int]], rank: int, group: Any,
                        label: str) -> torch.Tensor:
    """The full tensor from every rank's block when the block stacks this rank's piece of each
    sub-parameter (`part_sizes`: each sub-parameter's widths in rank order): each sub-parameter
    is gathered on its own, then they are stacked back. Collective over `group` (one gather per
    sub-parameter); not differentiable."""
    pieces = local.split([widths[rank] for widths in part_sizes], dim)
    return torch.cat([gather_uneven(piece, dim, widths, group, f"{label} part {i}")
                      for i, (piece, widths) in enumerate(zip(pieces, part_sizes))], dim)


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a model holding tensor-parallel layers: each split
    parameter, under every key it has (tied weights, shared modules), all-gathered once over
    its layer's group and reassembled (Conv1D weights back in their [in, out] layout);
    everything else as it is. Collective over every layer's group."""
    split: Dict[int, Tuple[TensorParallelLayer, ParamShard]] = {}
    for module in model.modules():
        if isinstance(module, TensorParallelLayer):
            for pname, spec in module.param_shards().items():
                split.setdefault(id(getattr(module, pname)), (module, spec))
    out: Dict[str, torch.Tensor] = {}
    done: Dict[int, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in split:
            out[key] = value.detach()
            continue
        if id(value) not in done:
            layer, spec = split[id(value)]
            local = value.detach().contiguous()
            if spec.dim is None or layer.tp_size == 1:
                done[id(value)] = spec.assemble([local])
            elif spec.sub_widths:
                done[id(value)] = gather_parts_uneven(local, spec.dim, spec.sub_widths, layer.tp_rank, layer.group,
                                                      f"tp full_state_dict {key}")
            elif spec.sizes:
                done[id(value)] = gather_uneven(local, spec.dim, spec.sizes, layer.group, f"tp full_state_dict {key}")
            else:
                gathered = torch.empty((layer.tp_size,) + tuple(local.shape), dtype=local.dtype, device=local.device)
                comm.all_gather_into_tensor(gathered, local.unsqueeze(0), group=layer.group,
                                            label=f"tp full_state_dict {key}")
                done[id(value)] = spec.assemble(list(gathered.unbind(0)))
        out[key] = done[id(value)]
    return out


def load_full_state_dict(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (full_state_dict's, or a one-process model's) into a model
    holding tensor-parallel layers: each split parameter takes this rank's slice, everything
    else is copied whole. Keys must match exactly (a missing or unexpected key is one line).
    No collective: every rank reads the full tensors it is given (resuming at another tp size)."""
    split: Dict[int, Tuple[TensorParallelLayer, str]] = {}
    for module in model.modules():
        if isinstance(module, TensorParallelLayer):
            for pname in module.param_shards():
                split.setdefault(id(getattr(module, pname)), (module, pname))
    mine = model.state_dict(keep_vars=True)
    missing = sorted(set(mine) - set(state_dict))
    extra = sorted(set(state_dict) - set(mine))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model does not"
        raise TensorParallelError(f"tensor parallel: the state dict {what} ({len(missing)} missing, "
                                  f"{len(extra)} unexpected)")
    with torch.no_grad():
        for key, target in mine.items():
            if id(target) in split:
                layer, pname = split[id(target)]
                layer.load_full_(pname, state_dict[key])
            else:
                target.copy_(state_dict[key])
