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

The fused and sub-parameter layers (GateUpPack_LinearLayer, fused_LinearLayer, SubParam*, Yuan_*)
build on these in autotp_subparam_layers.py.

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
from .layers import ParamShard, TensorParallelLayer, column_linear, gather_uneven, row_linear
from .mode import is_autotp_training_mode
from .shard import TensorParallelError
from .tp_shard import AutoTPMeta, get_shard_size_list
from .uc_meta import set_param_meta, shape_before_zero3


def _group_place(mp_group: Any) -> Tuple[int, int]:
    """(size, rank) of the group; a layer without a group is alone (tp 1), as in DeepSpeed."""
    if mp_group is None:
        return 1, 0
    return comm.get_world_size(mp_group), comm.get_rank(mp_group)


def _full_linear(module: nn.Module, what: str) -> Tuple[nn.Parameter, Optional[nn.Parameter]]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or len(shape_before_zero3(weight)) != 2:
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
        # a ZeRO-3 parameter is empty here; its shape before partitioning is the layer's
        self._orig_weight_shape = shape_before_zero3(self.weight)
        self._orig_bias_shape = shape_before_zero3(self.bias) if self.bias is not None else None
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

    def _mark_uc_metadata(self) -> None:
        """Write each parameter's universal-checkpoint description (uc_meta.py) from the frozen
        split and the current local shapes; called at construction and again by
        collect_autotp_universal_checkpoint_info, so a split changed since is what is published."""
        raise NotImplementedError

    def _param_shard(self, pname: str, dim: Optional[int]) -> ParamShard:
        """Where the local parameter sits in the full one (full_state_dict and norms read it)."""
        if dim is None:
            return ParamShard(None)
        return ParamShard(dim, self._orig_weight_shape[self.split_dim], sizes=self._partition_sizes)

    def _configure(self) -> None:
        """The shard map, DeepSpeed's tags and hooks, and trainability by the AutoTP mode."""
        split = dict(self._split_params())
        training = is_autotp_training_mode()
        for pname in ("weight", "bias"):
            param = getattr(self, pname)
            if param is None:
                continue
            dim = split.get(pname)
            self.shards[pname] = self._param_shard(pname, dim)
            if not training:
                param.requires_grad = False
            if dim is not None:
                param.gather_params = self.gather_params
                param._tp_partition = self._tp_partition
                param.ds_is_replaced_module = True
        self._mark_shards()
        self._mark_uc_metadata()
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

    def _mark_uc_metadata(self) -> None:
        out = self._orig_weight_shape[0]
        set_param_meta(self.weight, partition_type="column", partition_dim=0, logical_shape=self._orig_weight_shape,
                       output_shape=(out,), partition_sizes=self._partition_sizes,
                       target_partition_shape=tuple(self.weight.shape), original_shape=self._orig_weight_shape)
        set_param_meta(self.bias, partition_type="column", partition_dim=0, logical_shape=self._orig_bias_shape,
                       output_shape=self._orig_bias_shape, partition_sizes=self._partition_sizes,
                       target_partition_shape=None if self.bias is None else tuple(self.bias.shape),
                       original_shape=self._orig_bias_shape, is_bias=True)

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

    def _mark_uc_metadata(self) -> None:
        set_param_meta(self.weight, partition_type="row", partition_dim=1, logical_shape=self._orig_weight_shape,
                       output_shape=(self._orig_weight_shape[0],), partition_sizes=self._partition_sizes,
                       target_partition_shape=tuple(self.weight.shape), original_shape=self._orig_weight_shape)
        # the bias is added once after the sum: whole, the same on every rank
        set_param_meta(self.bias, partition_type="row", partition_dim=None, logical_shape=self._orig_bias_shape,
                       output_shape=self._orig_bias_shape, original_shape=self._orig_bias_shape, is_bias=True,
                       replicated=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self.weight, self.bias, self.group, label=self.label)

    def extra_repr(self) -> str:
        return (f"in={self.weight.shape[1]} of {self._orig_weight_shape[1]}, out={self._orig_weight_shape[0]}, "
                f"tp={self.tp_size}")


class LmHeadLinearAllreduce(LinearAllreduce):
    """DeepSpeed's row-parallel output head: the whole hidden state comes in, each rank
    multiplies its columns of it by its block of the weight, and the products are summed.

    The head gets Parameters of its own (a tied input embedding stays whole), is named
    "lm_head" for the shard sizes, and cuts its input with the split frozen when it was built:
    re-deriving it from tp_shard's process-wide settings, which a later model may change, would
    slice the input differently from the weight (and the sum would hide it)."""

    def __init__(self, module: nn.Module, mp_group: Any = None, name: Optional[str] = None,
                 tp_meta: Optional[AutoTPMeta] = None):
        module.weight = nn.Parameter(module.weight.detach().clone())
        if getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(module.bias.detach().clone())
        super().__init__(module, mp_group, name="lm_head", tp_meta=tp_meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sizes = self._partition_sizes
        if x.shape[-1] != sum(sizes):
            raise TensorParallelError(f"{self.label}: built for {sum(sizes)} input features, got {x.shape[-1]}")
        start = sum(sizes[:self.tp_rank])
        return row_linear(x[..., start:start + sizes[self.tp_rank]], self.weight, self.bias, self.group,
                          label=self.label)
