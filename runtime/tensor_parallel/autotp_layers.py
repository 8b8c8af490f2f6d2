"""DeepSpeed's AutoTP training layers (`deepspeed.module_inject.layers`): LinearLayer and
LinearAllreduce, built from a full nn.Linear and a process group, as DeepSpeed's scripts and
tests construct them by hand.

    LinearLayer(module, mp_group, skip_partition=False, gather_output=False, name=None)
        column parallel: rank r keeps rows [sum(sizes[:r]), +sizes[r]) of the weight and bias
    LinearAllreduce(module, mp_group, name=None)
        row parallel: rank r keeps those columns of the weight; the bias stays whole

`sizes` is DeepSpeed's split of the dimension (tp_shard.get_shard_size_list: grains of the
module's tp_grain_size, kv-head aware for attention layers, uneven sizes allowed), fixed once
when the layer is built (`_partition_sizes`). The layers keep the module's own Parameter
objects (the data is replaced by the rank's block), so an optimizer made before or after the
cut sees the same tensors. Each split parameter carries DeepSpeed's `gather_params(params)` and
`_tp_partition(params)`, which swap its data between the full tensor and the rank's block.

Fused projections (fused_qkv.py) are column layers whose rank block stacks a piece of each
sub-parameter, every sub-parameter split at its own (frozen) widths:

    GateUpPack_LinearLayer(module, mp_group, ..., name=None, tp_meta=None)
        the weight's two halves (gate, up) each split in grains (DeepSpeed's "mlp" sizing)
    fused_LinearLayer(module, mp_group, skip_partition=False, fused_module=block, ...)
        q, k, v (or one Bloom block) as fused_qkv reads the block's layout; QWen's
        attn.split_size is set to this rank's query width. CodeGen / GPTBigCode layouts
        are refused when cut or gathered (they are not split per sub-parameter).
    SubParamLinearLayer(module, mp_group, shape, partition_dim=0, name=None, tp_meta=None)
    SubParamLinearAllreduce(module, mp_group, shape, partition_dim=1, ...)
        a layer spec's 2-D `shape` names the sub-parameters of the split dimension (rows of a
        column layer, input columns of a row layer, whose bias stays whole); deeper views
        are refused (fused_qkv.shape_subparam_sizes)

They are ordinary TensorParallelLayers here: the forward is layers.py's column_linear /
row_linear, gradient norms and full_state_dict (the engine's consolidated state dict) read
their `shards`. As in DeepSpeed, the parameters are trainable only in AutoTP training mode
(mode.set_autotp_mode(training=True), which a config with tensor_parallel sets); otherwise
they are built frozen, for inference.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..core import comm
from .collectives import gather_last_dim
from . import fused_qkv
from .layers import ParamShard, TensorParallelLayer, column_linear, gather_parts_uneven, gather_uneven, row_linear
from .mode import is_autotp_training_mode
from .shard import TensorParallelError, take
from .tp_shard import AutoTPMeta, get_shard_size_list, settings_meta


def _group_place(mp_group: Any) -> Tuple[int, int]:
    """(size, rank) of the group; a layer without a group is alone (tp 1), as in DeepSpeed."""
    if mp_group is None:
        return 1, 0
    return comm.get_world_size(mp_group), comm.get_rank(mp_group)


def _full_linear(module: nn.Module, what: str) -> Tuple[nn.Parameter, Optional[nn.Parameter]]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TensorParallelError(f"{what}: {type(module).__name__} has no 2-D weight [out, in] to split")
    return weight, getattr(module, "bias", None)


class _AutoTPLinear(TensorParallelLayer):
    """What both layers share: DeepSpeed's attributes, the frozen split, and the parameter hooks."""

    split_dim: int  # the weight's dimension split over the group (0: column, 1: row)

    def _start(self, module: nn.Module, mp_group: Any, name: Optional[str], tp_meta: Optional[AutoTPMeta]) -> None:
        super().__init__()
        tp, rank = _group_place(mp_group)
        self._setup(mp_group, tp, rank, name)
        self.mp_group, self.name = mp_group, name
        self.tp_meta = tp_meta
        self.weight, self.bias = _full_linear(module, type(self).__name__)
        self._orig_weight_shape = tuple(self.weight.shape)
        self.support_training = True

    # DeepSpeed's names for the group's size and this rank (tp_size/tp_rank are ours)
    @property
    def tp_world_size(self) -> int:
        return self.tp_size

    @tp_world_size.setter
    def tp_world_size(self, value: int) -> None:
        self.tp_size = value

    @property
    def tp_index(self) -> int:
        return self.tp_rank

    @tp_index.setter
    def tp_index(self, value: int) -> None:
        self.tp_rank = value

    world_size = tp_world_size  # DeepSpeed's older names
    rank = tp_index

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        """DeepSpeed's split of `total` over the group, fixed for the layer's life (a later
        model changing tp_shard's settings must not move this layer's blocks)."""
        if self.tp_meta is not None:
            sizes = get_shard_size_list(total, self.tp_size, self.tp_meta, self.name)
        else:
            sizes = get_shard_size_list(total, self.tp_size, self.name)
        self._partition_sizes = tuple(sizes)
        return self._partition_sizes

    def _block(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full.split(self._partition_sizes, dim=dim)[self.tp_rank].detach().clone()

    def _split_params(self) -> List[Tuple[str, int]]:
        """(parameter name, dimension) of each parameter this layer splits."""
        raise NotImplementedError

    def _configure(self) -> None:
        """The shard map, DeepSpeed's tags and hooks, and trainability by the AutoTP mode."""
        split = dict(self._split_params())
        training = is_autotp_training_mode()
        for pname in ("weight", "bias"):
            param = getattr(self, pname)
            if param is None:
                continue
            dim = split.get(pname)
            self.shards[pname] = ParamShard(dim, self._orig_weight_shape[self.split_dim] if dim is not None else 0,
                                            sizes=self._partition_sizes if dim is not None else ())
            if not training:
                param.requires_grad = False
            if dim is not None:
                param.gather_params = self.gather_params
                param._tp_partition = self._tp_partition
                param.ds_is_replaced_module = True
        self._mark_shards()
        for pname in split:
            param = getattr(self, pname)
            if param is not None:
                param.tensor_model_parallel = True  # DeepSpeed tags split parameters at any group size

    @torch.no_grad()
    def gather_params(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        """Each split parameter of `params_list` becomes the full tensor (collective over the group)."""
        for param, (_, dim) in zip(params_list, self._split_params()):
            if param is None:
                continue
            if self.tp_size == 1:
                param.data = param.data.contiguous()
            else:
                param.data = gather_uneven(param.data, dim, self._partition_sizes, self.group,
                                           f"tp gather_params {self.label}")

    @torch.no_grad()
    def _tp_partition(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        """Each split parameter of `params_list` (full) becomes this rank's block again."""
        for param, (_, dim) in zip(params_list, self._split_params()):
            if param is not None:
                param.data = self._block(param.data, dim)


class LinearLayer(_AutoTPLinear):
    """DeepSpeed's column-parallel AutoTP layer: the weight's and bias's output rows are split.
    skip_partition keeps the module's tensors whole (DeepSpeed's fused layers cut them later);
    gather_output all-gathers the output features (unequal blocks allowed)."""

    split_dim = 0

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        self._start(module, mp_group, name, tp_meta)
        self.gather_output = gather_output
        self._freeze_partition_sizes(self._orig_weight_shape[0])
        if not skip_partition and self.tp_size > 1:
            self._tp_partition([self.weight, self.bias])
        self._configure()

    def _split_params(self) -> List[Tuple[str, int]]:
        return [("weight", 0), ("bias", 0)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_linear(x, self.weight, self.bias, self.group, label=self.label)
        if not self.gather_output or self.tp_size == 1:
            return y
        widest = max(self._partition_sizes)
        # pad to the widest block so one gather of equal tensors carries the blocks; its
        # backward hands each rank its padded block's gradient, which the pad's backward trims
        y = gather_last_dim(F.pad(y, (0, widest - y.shape[-1])), self.group, f"tp {self.label} gather output")
        blocks = y.split(widest, dim=-1)
        return torch.cat([b[..., :w] for b, w in zip(blocks, self._partition_sizes)], dim=-1)

    def extra_repr(self) -> str:
        return (f"in={self._orig_weight_shape[1]}, out={self.weight.shape[0]} of {self._orig_weight_shape[0]}, "
                f"tp={self.tp_size}, gather_output={self.gather_output}")


class LinearAllreduce(_AutoTPLinear):
    """DeepSpeed's row-parallel AutoTP layer: the weight's input columns are split, the partial
    products summed over the group, then the whole bias added once."""

    split_dim = 1

    def __init__(self, module: nn.Module, mp_group: Any = None, name: Optional[str] = None,
                 tp_meta: Optional[AutoTPMeta] = None):
        self._start(module, mp_group, name, tp_meta)
        self._freeze_partition_sizes(self._orig_weight_shape[1])
        if self.tp_size > 1:
            self._tp_partition([self.weight])
        self._configure()

    def _split_params(self) -> List[Tuple[str, int]]:
        return [("weight", 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self.weight, self.bias, self.group, label=self.label)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]} of {self._orig_weight_shape[1]}, out={self._orig_weight_shape[0]}, "
                f"tp={self.tp_size}")


class _BlockRef:
    """The block a fused layer belongs to, held outside the module tree (the layer is that
    block's child: registering the block back would make a cycle). DeepSpeed's `.module`."""

    def __init__(self, module: nn.Module):
        self.module = module


class SubParamColumnParallel(LinearLayer):
    """A column layer whose rank block stacks this rank's piece of every sub-parameter of a
    fused weight. A subclass sets `_subparam_layout_spec` = (sub-parameter sizes or None, layer
    name for the sizing) before LinearLayer builds it; the widths are frozen with the split."""

    _unsupported_reason = "its tensor parallel layout cannot be described per sub-parameter"
    _subparam_layout_spec: Tuple[Optional[Tuple[int, ...]], Optional[str]]

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        if gather_output:
            # DeepSpeed gathers such outputs in rank order, which interleaves the sub-parameters
            raise TensorParallelError(f"{type(self).__name__}: gather_output is not provided (its rank blocks stack "
                                      f"pieces of several sub-parameters, so a rank-order gather is not the output)")
        super().__init__(module, mp_group, skip_partition=skip_partition, name=name, tp_meta=tp_meta)

    def _meta(self) -> AutoTPMeta:
        return self.tp_meta if self.tp_meta is not None else settings_meta()

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        sizes = super()._freeze_partition_sizes(total)
        sub_sizes, sizing_name = self._subparam_layout_spec
        self._subparam_sizes = sub_sizes
        self._subparam_shard_widths = (fused_qkv.subparam_widths(sub_sizes, self.tp_size, self._meta(), sizing_name)
                                       if sub_sizes is not None else None)
        return sizes

    def _configure(self) -> None:
        super()._configure()
        if self._subparam_shard_widths is None:
            return
        parts = tuple(tuple(w) for w in self._subparam_shard_widths)
        for pname in ("weight", "bias"):
            if getattr(self, pname) is not None:
                self.shards[pname] = ParamShard(0, self._orig_weight_shape[0], part_sizes=parts)

    def _widths(self) -> List[List[int]]:
        if self._subparam_sizes is None:
            raise RuntimeError(f"{type(self).__name__} {self.label}: {self._unsupported_reason}")
        return self._subparam_shard_widths

    @torch.no_grad()
    def _tp_partition(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        """Each full parameter of `params_list` becomes this rank's stacked pieces, at the
        widths frozen when the layer was built (never re-read from tp_shard's settings)."""
        widths = self._widths()
        rows = fused_qkv.rank_rows(widths, self.tp_rank)
        for param in params_list:
            if param is None:
                continue
            if param.shape[0] != sum(self._subparam_sizes):
                raise TensorParallelError(f"{type(self).__name__} {self.label}: a tensor of {param.shape[0]} rows is "
                                          f"not the full fused parameter of {sum(self._subparam_sizes)}")
            param.data = take(param.data, 0, rows).detach().clone()

    @torch.no_grad()
    def gather_params(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        """Each parameter of `params_list` (this rank's pieces) becomes the full fused tensor,
        sub-parameter by sub-parameter (collective over the group)."""
        widths = self._widths()
        for param in params_list:
            if param is None:
                continue
            if self.tp_size == 1:
                param.data = param.data.contiguous()
            else:
                param.data = gather_parts_uneven(param.data, 0, widths, self.tp_rank, self.group,
                                                 f"tp gather_params {self.label}")


class GateUpPack_LinearLayer(SubParamColumnParallel):
    """DeepSpeed's layer for a packed gate+up projection (ChatGLM2/3): its two halves split
    separately, sized as an MLP layer (grains, never heads)."""

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        half = _full_linear(module, type(self).__name__)[0].shape[0] // 2
        self._subparam_layout_spec = ((half, half), "mlp")
        super().__init__(module, mp_group, skip_partition, gather_output, name, tp_meta)


class fused_LinearLayer(SubParamColumnParallel):  # noqa: N801  DeepSpeed's class name
    """DeepSpeed's layer for a fused qkv projection of the block `fused_module` (fused_qkv.py
    reads its layout)."""

    _unsupported_reason = ("its fused qkv layout interleaves or replicates blocks across tensor parallel ranks, "
                           "so it is not cut or gathered here (CodeGen / GPTBigCode layouts are not provided)")

    def __init__(self, module: nn.Module, mp_group: Any, skip_partition: bool = False, *,
                 fused_module: Optional[nn.Module] = None, gather_output: bool = False, name: Optional[str] = None,
                 tp_meta: Optional[AutoTPMeta] = None):
        if fused_module is None:
            raise TensorParallelError("fused_LinearLayer: 'fused_module' (the block holding the projection) is required")
        self.fused_module = _BlockRef(fused_module)
        weight = _full_linear(module, type(self).__name__)[0]
        meta = tp_meta if tp_meta is not None else settings_meta()
        # the fused qkv sizes are split without a layer name, as DeepSpeed sizes them
        self._subparam_layout_spec = (fused_qkv.subparam_sizes(fused_module, tuple(weight.shape), meta), None)
        super().__init__(module, mp_group, skip_partition, gather_output, name, tp_meta)

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        sizes = super()._freeze_partition_sizes(total)
        block = self.fused_module.module
        if self._subparam_shard_widths is not None and fused_qkv.fused_qkv_type(block) == "qwentype":
            # QWen unpacks q, k, v from the layer's output by attn.split_size: this rank's width
            block.attn.split_size = fused_qkv.qwen_split_size(self._subparam_shard_widths, self.tp_rank)
        return sizes


class SubParamLinearLayer(SubParamColumnParallel):
    """DeepSpeed's column layer for a layer spec with a `shape`: the weight's output rows are
    the sub-parameters `shape` names (fused_qkv.shape_subparam_sizes), each split at the
    layer's sizing (its name), the bias split as the rows."""

    def __init__(self, module: nn.Module, mp_group: Any, shape: Any, partition_dim: int = 0,
                 name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        self.shape, self.partition_dim = shape, partition_dim
        if partition_dim != 0:
            raise TensorParallelError(f"SubParamLinearLayer {name}: a column layer splits dim 0, not "
                                      f"partition_dim={partition_dim}")
        weight = _full_linear(module, type(self).__name__)[0]
        sizes = fused_qkv.shape_subparam_sizes(tuple(weight.shape), shape, partition_dim, name)
        # -1 at the partition dim: one block of the whole dim (DeepSpeed reports its sizes as None)
        self._subparam_layout_spec = (sizes or (int(weight.shape[0]),), name)
        super().__init__(module, mp_group, name=name, tp_meta=tp_meta)


class SubParamLinearAllreduce(LinearAllreduce):
    """DeepSpeed's row layer for a layer spec with a `shape`: the weight's input columns are
    the sub-parameters `shape` names, each split at the layer's sizing; the bias stays whole
    (added once after the sum), and is recognised by identity, not by its place in a list."""

    def __init__(self, module: nn.Module, mp_group: Any, shape: Any, partition_dim: int = 1,
                 name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        self.shape, self.partition_dim = shape, partition_dim
        if partition_dim != 1:
            raise TensorParallelError(f"SubParamLinearAllreduce {name}: a row layer splits dim 1, not "
                                      f"partition_dim={partition_dim}")
        weight = _full_linear(module, type(self).__name__)[0]
        self._subparam_sizes = fused_qkv.shape_subparam_sizes(tuple(weight.shape), shape, partition_dim, name)
        self._layout_sizes = self._subparam_sizes or (weight.shape[1],)
        super().__init__(module, mp_group, name=name, tp_meta=tp_meta)

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        sizes = super()._freeze_partition_sizes(total)
        meta = self.tp_meta if self.tp_meta is not None else settings_meta()
        self._subparam_shard_widths = fused_qkv.subparam_widths(self._layout_sizes, self.tp_size, meta, self.name)
        return sizes

    def _configure(self) -> None:
        super()._configure()
        parts = tuple(tuple(w) for w in self._subparam_shard_widths)
        self.shards["weight"] = ParamShard(1, self._orig_weight_shape[1], part_sizes=parts)

    @torch.no_grad()
    def _tp_partition(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        rows = fused_qkv.rank_rows(self._subparam_shard_widths, self.tp_rank)
        for param in params_list:
            if param is None or param is self.bias:
                continue
            param.data = take(param.data, 1, rows).detach().clone()

    @torch.no_grad()
    def gather_params(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        for param in params_list:
            if param is None or param is self.bias:
                continue
            if self.tp_size == 1:
                param.data = param.data.contiguous()
            else:
                param.data = gather_parts_uneven(param.data, 1, self._subparam_shard_widths, self.tp_rank, self.group,
                                                 f"tp gather_params {self.label}")
