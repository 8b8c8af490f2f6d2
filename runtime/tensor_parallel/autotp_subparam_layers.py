"""DeepSpeed's AutoTP layers for fused weights (`deepspeed.module_inject.layers`): a weight that
holds several sub-parameters side by side (q|k|v, gate|up) is cut per sub-parameter, each rank
keeping one piece of each, concatenated (subparams.py has the maths).

    SubParamLinearLayer(module, mp_group, shape, partition_dim=0, name=None)      column parallel
    SubParamLinearAllreduce(module, mp_group, shape, partition_dim=1, name=None)  row parallel
    GateUpPack_LinearLayer(module, mp_group=None, name=None)   chatGLM's gate|up halves, "mlp" split
    fused_LinearLayer(module, mp_group, skip_partition=False, fused_module=..., name=None)
    Yuan_LinearLayer / Yuan_LinearAllreduce(module, mp_group, name=None)

`shape` views the weight (subparams.infer_layout). The per-rank widths are fixed when the layer
is built (`_subparam_shard_widths`), and partition, gather, full_state_dict and the
universal-checkpoint metadata all read them, so they agree on every cut.

A fused qkv layer reads its block's layout with fused_qkv.py; without a tp_meta, the fused
layers size their split from tp_shard's module settings read when built (DeepSpeed's older
convention). What is refused, in one line: gather_output on a fused column layer (a rank-order
gather interleaves the sub-parameters), cutting or gathering CodeGen's and GPTBigCode's fused
layouts, Yuan's shared-QK head selection at tp > 1, and a sub-parameter split on a middle
dimension of a >2-D view at tp > 1 (its pieces are strided in the 2-D weight, which
full_state_dict cannot place). CodeGen's and GPTBigCode's
fused layouts and Yuan's are published as unsupported in the universal-checkpoint info, with
the reason, as DeepSpeed does.
"""
from __future__ import annotations

from math import prod
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .autotp_layers import LinearAllreduce, LinearLayer, _AutoTPLinear
from . import fused_qkv
from .layers import ParamShard, column_linear, gather_parts_uneven, row_linear
from .shard import TensorParallelError
from .subparams import bias_shape_spec, infer_layout, subparam_shard_widths, take_rank_pieces
from .tp_shard import AutoTPMeta, settings_meta
from .uc_meta import set_param_meta


def _meta_or_settings(tp_meta: Optional[AutoTPMeta]) -> AutoTPMeta:
    """The layer's meta, or (DeepSpeed's older convention, no meta passed) tp_shard's module
    settings read now, so the split is frozen when the layer is built."""
    return tp_meta if tp_meta is not None else settings_meta()


class _SubParamMixin:
    """Cut and gather by sub-parameter pieces along `dim` of a logical view of the tensor."""

    def _cut(self, t: torch.Tensor, view: Tuple[int, ...], dim: int) -> torch.Tensor:
        piece = take_rank_pieces(t.reshape(view), dim, self._sub_sizes(view, dim), self._subparam_shard_widths,
                                 self.tp_rank)
        return piece.detach().clone()

    def _sub_sizes(self, view: Sequence[int], dim: int) -> Tuple[int, ...]:
        return tuple(self._subparam_sizes) if self._subparam_sizes else (view[dim],)

    def _gather(self, local: torch.Tensor, view: Tuple[int, ...], dim: int) -> torch.Tensor:
        """The full tensor of `view`'s shape from every rank's pieces (collective over the group)."""
        local_view = list(view)
        local_view[dim] = sum(w[self.tp_rank] for w in self._subparam_shard_widths)
        return gather_parts_uneven(local.reshape(local_view), dim, self._subparam_shard_widths, self.tp_rank,
                                   self.group, f"tp gather_params {self.label}")

    def _sub_shard(self, view: Sequence[int], dim: Optional[int], local_dim: int, is_weight: bool) -> ParamShard:
        """The pieces' place in the 2-D weight (or the 1-D bias): a split on the view's first
        dimension is whole rows, scaled by the dimensions inside it; one on the weight view's
        last dimension is its input columns. A split in between is strided and has no place."""
        if dim is None:
            return ParamShard(None)
        if is_weight and dim == len(view) - 1:
            scale = 1
        elif dim == 0:
            scale = prod(view[1:-1]) if is_weight else prod(view[1:])
        elif self.tp_size > 1:
            raise TensorParallelError(f"{self.label}: a sub-parameter split on dimension {dim} of the view "
                                      f"{tuple(view)} is strided in the weight, which is not provided at "
                                      f"tp {self.tp_size}")
        else:
            return ParamShard(None)
        widths = tuple(tuple(w * scale for w in per_rank) for per_rank in self._subparam_shard_widths)
        return ParamShard(local_dim, sum(sum(w) for w in widths), sub_widths=widths)


class _SubParamLinear(_SubParamMixin, _AutoTPLinear):
    """What both SubParam layers share: the layout of `shape` and the frozen widths."""

    def _build(self, module: nn.Module, mp_group: Any, shape, partition_dim: int, name: Optional[str],
               tp_meta: Optional[AutoTPMeta]) -> None:
        self._start(module, mp_group, name, tp_meta)
        self.shape, self.partition_dim = shape, partition_dim
        layout = infer_layout(self._orig_weight_shape, shape, partition_dim, name)
        self._logical_shape, self._output_shape = layout.logical_shape, layout.output_shape
        self._subparam_sizes, self._bias_partition_dim = layout.sub_sizes, layout.bias_partition_dim
        self._bias_shape_spec = bias_shape_spec(layout)
        self._freeze_partition_sizes(self._orig_weight_shape[self.split_dim])
        if self.bias is not None and self.bias.numel() != prod(self._output_shape):
            raise TensorParallelError(f"{self.label}: bias of {self.bias.numel()} does not match the output shape "
                                      f"{self._output_shape}")
        if self.tp_size > 1:
            self._tp_partition([self.weight, self.bias])
        self._configure()

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        """Each sub-parameter's per-rank widths at the group's size now (DeepSpeed's scripts set
        tp_world_size / tp_index and call this again), from the layer's meta or else tp_shard's
        module settings, fixed until the next call."""
        self._subparam_shard_widths = subparam_shard_widths(
            self._sub_sizes(self._logical_shape, self.partition_dim), self.tp_size, _meta_or_settings(self.tp_meta),
            self.name)
        self._partition_sizes = ()  # not one block per rank: the pieces are in _subparam_shard_widths
        return self._partition_sizes

    def _is_bias(self, param) -> bool:
        return self.bias is not None and param is self.bias

    @torch.no_grad()
    def _tp_partition(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        for param in params_list:
            if param is None:
                continue
            if self._is_bias(param):
                if self._bias_split():
                    param.data = self._cut(param.data, self._output_shape, self._bias_partition_dim).reshape(-1)
                continue
            piece = self._cut(param.data, self._logical_shape, self.partition_dim)
            param.data = piece.reshape(prod(piece.shape[:-1]), piece.shape[-1])  # -1 is ambiguous at width 0

    @torch.no_grad()
    def gather_params(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        for param in params_list:
            if param is None:
                continue
            if self._is_bias(param):
                if self._bias_split() and self.tp_size > 1:
                    param.data = self._gather(param.data, self._output_shape,
                                              self._bias_partition_dim).reshape(self._orig_bias_shape)
                continue
            if self.tp_size == 1:
                param.data = param.data.contiguous()
            else:
                param.data = self._gather(param.data, self._logical_shape,
                                          self.partition_dim).reshape(self._orig_weight_shape)

    def _bias_split(self) -> bool:
        raise NotImplementedError

    def _split_params(self) -> List[Tuple[str, int]]:
        split = [("weight", self.split_dim)]
        return split + ([("bias", 0)] if self._bias_split() else [])

    def _param_shard(self, pname: str, dim: Optional[int]) -> ParamShard:
        if dim is None:
            return ParamShard(None)
        if pname == "bias":
            return self._sub_shard(self._output_shape, self._bias_partition_dim, 0, is_weight=False)
        return self._sub_shard(self._logical_shape, self.partition_dim, self.split_dim, is_weight=True)


class SubParamLinearLayer(_SubParamLinear):
    """Column parallel by sub-parameter (DeepSpeed's SubParamLinearLayer)."""

    split_dim = 0

    def __init__(self, module: nn.Module, mp_group: Any = None, shape=None, partition_dim: int = 0,
                 name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        if shape is None:
            raise TensorParallelError("SubParamLinearLayer: shape (the sub-parameter view of the weight) is required")
        self._build(module, mp_group, shape, partition_dim, name, tp_meta)

    def _bias_split(self) -> bool:
        return self._bias_partition_dim is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_linear(x, self.weight, self.bias, self.group, label=self.label)

    def _mark_uc_metadata(self) -> None:
        split = self._bias_split()
        set_param_meta(self.weight, partition_type="column", partition_dim=self.partition_dim,
                       logical_shape=self._logical_shape, output_shape=self._output_shape, sub_param_shape=self.shape,
                       sub_param_sizes=self._subparam_sizes, sub_param_shard_widths=self._subparam_shard_widths,
                       target_partition_shape=tuple(self.weight.shape), original_shape=self._orig_weight_shape)
        set_param_meta(self.bias, partition_type="column", partition_dim=self._bias_partition_dim,
                       logical_shape=self._output_shape, output_shape=self._output_shape,
                       sub_param_shape=self._bias_shape_spec, sub_param_sizes=self._subparam_sizes if split else None,
                       sub_param_shard_widths=self._subparam_shard_widths if split else None,
                       target_partition_shape=None if self.bias is None else tuple(self.bias.shape),
                       original_shape=self._orig_bias_shape, is_bias=True, replicated=not split)


class SubParamLinearAllreduce(_SubParamLinear):
    """Row parallel by sub-parameter (DeepSpeed's SubParamLinearAllreduce): the bias is whole."""

    split_dim = 1

    def __init__(self, module: nn.Module, mp_group: Any = None, shape=None, partition_dim: int = 1,
                 name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        if shape is None:
            raise TensorParallelError("SubParamLinearAllreduce: shape (the sub-parameter view of the weight) is "
                                      "required")
        self._build(module, mp_group, shape, partition_dim, name, tp_meta)

    def _bias_split(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self.weight, self.bias, self.group, label=self.label)

    def _mark_uc_metadata(self) -> None:
        set_param_meta(self.weight, partition_type="row", partition_dim=self.partition_dim,
                       logical_shape=self._logical_shape, output_shape=self._output_shape, sub_param_shape=self.shape,
                       sub_param_sizes=self._subparam_sizes, sub_param_shard_widths=self._subparam_shard_widths,
                       target_partition_shape=tuple(self.weight.shape), original_shape=self._orig_weight_shape)
        set_param_meta(self.bias, partition_type="row", partition_dim=None, logical_shape=self._orig_bias_shape,
                       output_shape=self._orig_bias_shape, original_shape=self._orig_bias_shape,
                       target_partition_shape=None if self.bias is None else tuple(self.bias.shape), is_bias=True,
                       replicated=True)


class SubParamColumnParallel(_SubParamMixin, LinearLayer):
    """A LinearLayer whose output rows are sub-parameters cut separately (DeepSpeed's base of
    GateUpPack_LinearLayer and fused_LinearLayer). A subclass sets `_subparam_layout_spec`,
    (sizes or None, shard name), before building; None sizes mean a fused layout with no
    per-sub-parameter description, which cannot be cut, gathered or converted here."""

    _unsupported_uc_reason = "its tensor parallel layout cannot be described per sub-parameter"
    _subparam_layout_spec: Tuple[Optional[Tuple[int, ...]], Optional[str]] = (None, None)

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, name: Optional[str] = None, tp_meta: Optional[AutoTPMeta] = None):
        if gather_output:
            # DeepSpeed gathers such outputs in rank order, which interleaves the sub-parameters
            raise TensorParallelError(f"{type(self).__name__}: gather_output is not provided (its rank blocks stack "
                                      f"pieces of several sub-parameters, so a rank-order gather is not the output)")
        super().__init__(module, mp_group, skip_partition=skip_partition, name=name, tp_meta=tp_meta)

    def _meta(self) -> AutoTPMeta:
        return _meta_or_settings(self.tp_meta)

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        sizes = super()._freeze_partition_sizes(total)
        self._subparam_sizes, shard_name = self._subparam_layout_spec
        self._subparam_shard_widths = None
        if self._subparam_sizes is not None:
            self._subparam_shard_widths = subparam_shard_widths(self._subparam_sizes, self.tp_size, self._meta(),
                                                                shard_name)
        return sizes

    @property
    def _logical_shape(self) -> Tuple[int, ...]:
        return self._orig_weight_shape

    @torch.no_grad()
    def _tp_partition(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        if self._subparam_sizes is None:
            raise TensorParallelError(f"{self.label}: cannot be split at tp {self.tp_size}: "
                                      f"{self._unsupported_uc_reason}")
        for param in params_list:
            if param is not None:
                view = self._orig_bias_shape if param.dim() == 1 else self._orig_weight_shape
                param.data = self._cut(param.data, view, 0)

    @torch.no_grad()
    def gather_params(self, params_list: Sequence[Optional[torch.Tensor]]) -> None:
        if self._subparam_sizes is None:
            # a rank-order concatenation is not how the layout was cut: refuse, never guess
            raise RuntimeError(f"{self.label}: {self._unsupported_uc_reason}")
        for param in params_list:
            if param is None:
                continue
            view = self._orig_bias_shape if param.dim() == 1 else self._orig_weight_shape
            param.data = param.data.contiguous() if self.tp_size == 1 else self._gather(param.data, view, 0)

    def _param_shard(self, pname: str, dim: Optional[int]) -> ParamShard:
        if dim is None or self._subparam_sizes is None:
            return ParamShard(None)  # unsplit (tp 1, or skip_partition: the tensors are whole)
        view = self._orig_bias_shape if pname == "bias" else self._orig_weight_shape
        return self._sub_shard(view, 0, 0, is_weight=pname != "bias")

    def _spec(self, shape: Tuple[int, ...]) -> Tuple:
        return (tuple(self._subparam_sizes),) + tuple(shape[1:])

    def _mark_uc_metadata(self) -> None:
        for param, shape, is_bias in ((self.weight, self._orig_weight_shape, False),
                                      (self.bias, self._orig_bias_shape, True)):
            if param is None:
                continue
            if self._subparam_sizes is None:
                set_param_meta(param, partition_type="column", partition_dim=0, logical_shape=shape,
                               original_shape=shape, is_bias=is_bias, unsupported_reason=self._unsupported_uc_reason)
                continue
            set_param_meta(param, partition_type="column", partition_dim=0, logical_shape=shape,
                           output_shape=(shape[0],) if not is_bias else shape, sub_param_shape=self._spec(shape),
                           sub_param_sizes=self._subparam_sizes, sub_param_shard_widths=self._subparam_shard_widths,
                           target_partition_shape=tuple(param.shape), original_shape=shape, is_bias=is_bias)


class GateUpPack_LinearLayer(SubParamColumnParallel):
    """chatGLM's packed gate|up projection: two equal halves, each split with the "mlp" name."""

    def __init__(self, module: nn.Module, mp_group: Any = None, name: Optional[str] = None,
                 tp_meta: Optional[AutoTPMeta] = None, **kwargs: Any):
        half = module.weight.shape[0] // 2
        self._subparam_layout_spec = ((half, half), "mlp")
        super().__init__(module, mp_group, name=name, tp_meta=tp_meta, **kwargs)


class _BlockRef:
    """The block a fused layer belongs to, held outside the module tree (the layer is that
    block's child: registering the block back would make a cycle). DeepSpeed's `.module`."""

    def __init__(self, module: nn.Module):
        self.module = module


class fused_LinearLayer(SubParamColumnParallel):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's fused qkv column layer for the block `fused_module`: fused_qkv.py reads the
    block's layout (q, k, v, or Bloom's one stacked block) from the layer's meta, or from
    tp_shard's module settings when none is given, and each sub-parameter is split on its own
    (head aware). QWen's attn.split_size is set to this rank's query width. CodeGen's and
    GPTBigCode's layouts interleave or replicate blocks across ranks: they work whole (tp 1,
    skip_partition), are refused when cut or gathered, and are published as unsupported in the
    universal-checkpoint info, with the reason, as DeepSpeed does."""

    _unsupported_uc_reason = ("its fused qkv layout interleaves or replicates blocks across tensor parallel "
                              "ranks, so the original parameter cannot be reassembled from the shards")

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 fused_module: Optional[nn.Module] = None, name: Optional[str] = None,
                 tp_meta: Optional[AutoTPMeta] = None, **kwargs: Any):
        if fused_module is None:
            raise TensorParallelError("fused_LinearLayer: 'fused_module' (the block holding the fused qkv) is required")
        self.fused_module = _BlockRef(fused_module)
        self.fused_module_type = type(fused_module).__name__
        # the fused qkv sizes are split without a layer name, as DeepSpeed sizes them
        self._subparam_layout_spec = (fused_qkv.subparam_sizes(fused_module, tuple(module.weight.shape),
                                                               _meta_or_settings(tp_meta)), None)
        super().__init__(module, mp_group, skip_partition=skip_partition, name=name, tp_meta=tp_meta, **kwargs)

    def _freeze_partition_sizes(self, total: int) -> Tuple[int, ...]:
        sizes = super()._freeze_partition_sizes(total)
        block = self.fused_module.module
        if self._subparam_shard_widths is not None and fused_qkv.fused_qkv_type(block) == "qwentype":
            # QWen unpacks q, k, v from the layer's output by attn.split_size: this rank's width
            block.attn.split_size = fused_qkv.qwen_split_size(self._subparam_shard_widths, self.tp_rank)
        return sizes


_YUAN_REASON = ("Yuan shared-QK tensor parallelism selects noncontiguous head groups that universal checkpoint "
                "conversion cannot currently describe")


class _Yuan:
    """Yuan2's shared-QK split picks noncontiguous head groups: its cut (DeepSpeed's
    shard_value_with_share_qk) is not provided, so tp > 1 is refused; at tp 1 the layer works
    and its parameters are published as unsupported for universal checkpoints."""

    _unsupported_uc_reason = _YUAN_REASON

    def _tp_partition(self, params_list) -> None:
        raise TensorParallelError(f"{self.label}: Yuan's shared-QK split (shard_value_with_share_qk) is not "
                                  f"provided by dslaunch, so it cannot run at tp {self.tp_size}")

    def gather_params(self, params_list) -> None:
        raise RuntimeError(f"{self.label}: {_YUAN_REASON}")

    def _param_shard(self, pname: str, dim: Optional[int]) -> ParamShard:
        return ParamShard(None)  # only ever built whole (tp 1)

    def _mark_uc_metadata(self) -> None:
        kind = "column" if self.split_dim == 0 else "row"
        set_param_meta(self.weight, partition_type=kind, partition_dim=self.split_dim,
                       logical_shape=self._orig_weight_shape, original_shape=self._orig_weight_shape,
                       unsupported_reason=_YUAN_REASON)
        set_param_meta(self.bias, partition_type=kind, partition_dim=0 if kind == "column" else None,
                       logical_shape=self._orig_bias_shape, original_shape=self._orig_bias_shape, is_bias=True,
                       unsupported_reason=_YUAN_REASON)


class Yuan_LinearLayer(_Yuan, LinearLayer):  # noqa: N801 (DeepSpeed's name)
    pass


class Yuan_LinearAllreduce(_Yuan, LinearAllreduce):  # noqa: N801 (DeepSpeed's name)
    pass
