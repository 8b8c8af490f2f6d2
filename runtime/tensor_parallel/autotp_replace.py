"""DeepSpeed's AutoTP class (`deepspeed.module_inject.auto_tp.AutoTP`): a model's layers replaced,
one module at a time, by DeepSpeed's AutoTP layers, as scripts and DeepSpeed's tests drive it:

    autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None,
                    linear_layer_setting=None, orig_layer_impl=None, partition_config=config)
    autotp.set_tensor_parallel_config(tp_size, group)
    autotp.update_linear_policies()
    autotp._replace_module(model)

The walk goes down the module tree with each module's full path (`layers.0.self_attn.q_proj`);
with a `partition_config` (an AutoTPConfig) each module holding a 2-D weight is routed by the
first layer spec whose pattern matches `<path>.weight` (re.match), DeepSpeed 0.19.8's
configurable path: column -> LinearLayer (with `shape`: SubParamLinearLayer), row ->
LinearAllreduce (SubParamLinearAllreduce), the output head row-parallel -> LmHeadLinearAllreduce,
skip or no match -> left as it is (strict_mode: no match is an error); an nn.Embedding a spec
names is cut along its hidden dimension (`_slice_embedding`). A column layer with gathered
output whose weight is tied to an embedding is left whole with its embedding, so the tie holds.
After a module's children are replaced, its head-count and width attributes (num_heads,
hidden_size, ...) are divided the way its weights were (`update_mp_params`), but only when a
parameter below it was actually split.

The layers are autotp_layers.py's and autotp_subparam_layers.py's; the split sizes are
tp_shard's, from the model's own AutoTPMeta (`model_config`, `tp_grain_size`).

What is refused, in one line (TensorParallelError): DeepSpeed's name heuristics without a
partition_config (its inference-injection router, with the fused-qkv, Yuan, GLM and Arctic
special cases) and its model-policy parser; loading weights from `state_dict` during the walk;
`keep_module_on_host`; `vocab_parallel_lm_head`; GPT-2's Conv1D layers; a row-parallel output
head in training mode; a model partitioned by ZeRO-3 (deepspeed.zero.Init).
"""
from __future__ import annotations

import logging
import re
from typing import Any, Dict, List, Optional, Set

import torch
from torch import nn

from ..core import comm
from ..core.accelerator import get_accelerator
from ..core.parallel import groups
from .autotp_config import AutoTPConfig, PartitionType, TPLayerSpec
from .autotp_layers import LinearAllreduce, LinearLayer, LmHeadLinearAllreduce
from .autotp_subparam_layers import SubParamLinearAllreduce, SubParamLinearLayer
from .mode import is_autotp_training_mode
from .shard import TensorParallelError
from .tp_shard import AutoTPMeta, get_shard_size, get_shard_size_list
from .uc_keys import DS_AUTOTP_UC_META
from .uc_meta import build_restore_meta, shape_before_zero3

__all__ = ["AutoTP", "AutoTPConfig", "PartitionType", "TPLayerSpec"]

logger = logging.getLogger(__name__)

# The module attributes DeepSpeed divides after replacing a module's children (head counts and
# widths its forward reshapes by); Yuan's embed_dim stays whole.
MP_PARAMS = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads", "all_head_size",
             "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads", "kv_n_heads", "d_model",
             "num_attention_heads_per_partition", "num_multi_query_groups_per_partition",
             "hidden_size_per_partition")
# DeepSpeed's default names of the output head, when no partition_config names others
DEFAULT_LM_HEADS = ("lm_head", "embed_out")
# a class name yields a model type ("LlamaDecoderLayer" -> "llama"), the first pattern that matches
_MODEL_TYPE_FROM_CLASS = (r"(\w+)DecoderLayer", r"(\w+)Block", r"(\w+)Layer")


def _refuse(what: str) -> TensorParallelError:
    return TensorParallelError(f"deepspeed.module_inject.auto_tp.AutoTP: {what}")


def _weight_ndim(weight: Any) -> int:
    """A weight's dimensions; a ZeRO-3 parameter's are those of its shape before partitioning."""
    if not isinstance(weight, torch.Tensor):
        return 0
    return len(shape_before_zero3(weight))


class AutoTP:
    """DeepSpeed's AutoTP for one model (the module docstring has the walk and what is refused)."""

    # Defaults of what __init__ sets, so the helpers DeepSpeed's tests call on an instance made
    # without __init__ (object.__new__) answer: no per-model meta means tp_shard's module
    # settings size the split, DeepSpeed's earlier convention.
    tp_meta: Optional[AutoTPMeta] = None
    partition_config: Optional[AutoTPConfig] = None
    training_mode = False
    mp_size: Optional[int] = None
    mp_group: Any = None
    module: Optional[nn.Module] = None

    def __init__(self, module: nn.Module, all_reduce_linears, prefix: str, state_dict, linear_layer_setting,
                 orig_layer_impl, keep_module_on_host: bool = False, partition_config: Optional[AutoTPConfig] = None,
                 vocab_parallel_lm_head: bool = False, model_config: Any = None, tp_grain_size: int = 1,
                 training_mode: bool = False):
        if state_dict is not None:
            raise _refuse("state_dict (loading checkpoint weights into meta-tensor modules during the walk) is not "
                          "provided; load the weights into the model first and pass state_dict=None")
        if keep_module_on_host:
            raise _refuse("keep_module_on_host is not provided; the layers keep their shards where the module is")
        if vocab_parallel_lm_head:
            raise _refuse("vocab_parallel_lm_head is not provided; name the output head in a column layer spec "
                          "with gather_output")
        if partition_config is not None and not isinstance(partition_config, AutoTPConfig):
            raise _refuse(f"partition_config must be an AutoTPConfig (AutoTPConfig.from_dict(...)), got "
                          f"{type(partition_config).__name__}")
        self.module = module
        self.all_reduce_linears = list(all_reduce_linears or [])
        self.prefix = prefix
        self.state_dict = None
        self.linear_layer_setting = linear_layer_setting
        self.orig_layer_impl = orig_layer_impl
        self.partition_config = partition_config
        self.training_mode = training_mode
        self.tp_meta = AutoTPMeta.from_model_config(model_config, tp_grain_size)
        self.mp_size = None
        self.mp_group = None
        self.linear_policies: Optional[Dict[type, Any]] = None
        self.conv_linear_layer = False
        self._tie_fallbacks_configured = False
        self._tied_gathered_column_module_names: Set[str] = set()

    # -- DeepSpeed's inference-policy parser --------------------------------------------------
    @staticmethod
    def tp_parser(model: nn.Module):
        raise _refuse("tp_parser (DeepSpeed's model-policy inference for kernel injection) is not provided; give "
                      "a partition_config")

    # -- setup -----------------------------------------------------------------------------------
    def set_tensor_parallel_config(self, mp_size: int, mp_group: Any) -> None:
        """The group to split over; in AutoTP training mode it is the engine's tensor-parallel
        group, whatever is passed (as in DeepSpeed)."""
        if is_autotp_training_mode():
            self.mp_group = groups.get_tensor_model_parallel_group()
            self.mp_size = groups.get_tensor_model_parallel_world_size()
            return
        self.mp_size = mp_size
        self.mp_group = mp_group

    def update_linear_policies(self) -> None:
        """Which module classes the walk replaces and how, without a partition_config (with one,
        the layer specs route every module and these are not read)."""
        self.conv_linear_layer = False
        if self.linear_layer_setting is not None:
            self.linear_policies = {self.linear_layer_setting[0]: self._replace}
            if len(self.linear_layer_setting) == 2:
                self.linear_policies[self.linear_layer_setting[1]] = self._slice_embedding
            return
        if self.orig_layer_impl is not None and getattr(self.orig_layer_impl, "__name__", "") == "GPT2Block":
            raise _refuse("GPT-2's Conv1D layers (orig_layer_impl=GPT2Block) are not provided")
        self.linear_policies = {nn.Linear: self._replace, nn.Embedding: self._slice_embedding}

    def _replace(self, child: nn.Module, name: str, conv_linear_layer: bool = False):
        raise _refuse(f"{name}: replacing layers by DeepSpeed's name heuristics (no partition_config) is not "
                      "provided; give a partition_config (AutoTPConfig) with layer specs")

    # -- the walk ------------------------------------------------------------------------------
    def _replace_module(self, r_module: nn.Module, prev_name: str = "", prev_class_name: str = "") -> nn.Module:
        """Replace the layers below `r_module`, whose path is prev_class_name.prev_name (empty for
        the model), in place; returns `r_module`."""
        path = ".".join(p for p in (prev_class_name, prev_name) if p)
        if not path:
            self._configure_gathered_column_tie_fallbacks()
        for name, child in list(r_module.named_children()):
            full_name = f"{path}.{name}" if path else name
            if self.partition_config is not None:
                new = self._route_by_config(child, full_name)
            else:
                new = self._route_by_policy(child, full_name)
            if new is _DESCEND:
                self._replace_module(child, name, path)
                self.update_mp_params(child, full_name)
            elif new is not None:
                setattr(r_module, name, new)
        return r_module

    def _route_by_config(self, child: nn.Module, full_name: str):
        if full_name in self._tied_gathered_column_module_names:
            return None
        if isinstance(child, nn.Embedding):
            spec = self.partition_config.find_matching_spec(f"{full_name}.weight", self._get_model_type())
            if spec is not None and spec.partition_type != PartitionType.SKIP:
                return self._slice_embedding(child, full_name, False)
            return None
        if _weight_ndim(getattr(child, "weight", None)) == 2:
            if type(child).__name__ == "Conv1D":  # transformers' GPT-2 layer: its weight is stored [in, out]
                spec = self.partition_config.find_matching_spec(f"{full_name}.weight", self._get_model_type())
                if spec is not None and spec.partition_type != PartitionType.SKIP:
                    raise _refuse(f"{full_name}: GPT-2's Conv1D layers (weight stored [in, out]) are not provided")
                return None
            return self._replace_with_config(child, full_name)
        return _DESCEND

    def _route_by_policy(self, child: nn.Module, full_name: str):
        if self.linear_policies is None:
            raise _refuse("update_linear_policies() must be called before _replace_module without a partition_config")
        policy = self.linear_policies.get(type(child))
        if policy is None:
            policy = next((p for cls, p in self.linear_policies.items() if isinstance(child, cls)), None)
        if policy is None:
            return _DESCEND
        return policy(child, full_name, self.conv_linear_layer)

    def _replace_with_config(self, child: nn.Module, name: str):
        """The layer the first matching spec asks for, or `child` itself (skip, no match)."""
        if getattr(child, "replaced", False):
            return child
        param_name = name if name.endswith(".weight") else f"{name}.weight"
        spec = self.partition_config.find_matching_spec(param_name, self._get_model_type())
        if spec is None:
            if self.partition_config.strict_mode:
                raise ValueError(f"No matching spec for {param_name}")
            return child
        setattr(child, "replaced", True)
        if spec.partition_type == PartitionType.SKIP:
            return child
        self._refuse_zero3(child, name)
        if spec.partition_type == PartitionType.ROW:
            return self._create_row_parallel_layer(child, spec, name)
        return self._create_column_parallel_layer(child, spec, name)

    def _create_row_parallel_layer(self, module: nn.Module, spec: TPLayerSpec, name: str) -> nn.Module:
        if self._is_lm_head_name(name):
            if self.training_mode:
                raise _refuse(f"{name}: a row-parallel output head in training mode is not provided; make it a "
                              "column spec with gather_output")
            return LmHeadLinearAllreduce(module, self.mp_group, tp_meta=self.tp_meta)
        if spec.shape is not None:
            return SubParamLinearAllreduce(module, self.mp_group, shape=spec.shape,
                                           partition_dim=spec.get_partition_dim(), name=name, tp_meta=self.tp_meta)
        return LinearAllreduce(module, self.mp_group, name=name, tp_meta=self.tp_meta)

    def _create_column_parallel_layer(self, module: nn.Module, spec: TPLayerSpec, name: str) -> nn.Module:
        if spec.shape is not None:
            if spec.gather_output:
                raise NotImplementedError("AutoTP gather_output does not yet support shaped sub-parameter layers.")
            return SubParamLinearLayer(module, self.mp_group, shape=spec.shape, partition_dim=spec.get_partition_dim(),
                                       name=name, tp_meta=self.tp_meta)
        return LinearLayer(module, self.mp_group, name=name, gather_output=spec.gather_output, tp_meta=self.tp_meta)

    def _refuse_zero3(self, module: nn.Module, name: str) -> None:
        if any(hasattr(p, "ds_status") for p in module.parameters(recurse=False)):
            raise _refuse(f"{name}: the model is partitioned by ZeRO-3 (deepspeed.zero.Init); AutoTP on it is not "
                          "provided here (build the model without zero.Init)")

    # -- output heads and ties -----------------------------------------------------------------
    def _lm_head_patterns(self) -> tuple:
        if self.partition_config is not None and self.partition_config.lm_head_patterns:
            return tuple(self.partition_config.lm_head_patterns)
        return DEFAULT_LM_HEADS

    def _is_lm_head_name(self, name: str) -> bool:
        # the last path segment only: "lm_head_proj" is not a head
        return str(name).split(".")[-1] in self._lm_head_patterns()

    def _configure_gathered_column_tie_fallbacks(self) -> None:
        """A layer whose weight is an embedding's and that a spec makes column-parallel with its
        output gathered stays whole, and so does the embedding: cutting one of them would break
        the tie (DeepSpeed warns and keeps both replicated)."""
        if self._tie_fallbacks_configured:
            return
        self._tie_fallbacks_configured = True
        if self.partition_config is None and not self.training_mode:
            return
        named = list(self.module.named_modules(remove_duplicate=False))
        embeddings = [(n, m) for n, m in named if isinstance(m, nn.Embedding)]
        get_input = getattr(self.module, "get_input_embeddings", None)
        if callable(get_input):
            emb = get_input()
            if emb is not None and hasattr(emb, "weight") and not any(m is emb for _, m in embeddings):
                emb_name = next((n for n, m in named if m is emb), None)
                if emb_name is not None:
                    embeddings.append((emb_name, emb))
        if not embeddings:
            return
        model_type = self._get_model_type()
        for name, m in named:
            if not name or isinstance(m, nn.Embedding) or not hasattr(m, "weight"):
                continue
            tied = [en for en, e in embeddings if m.weight is e.weight]
            if not tied:
                continue
            if self.partition_config is None:
                gathered = self._is_lm_head_name(name) and name in self.all_reduce_linears
            else:
                spec = self.partition_config.find_matching_spec(f"{name}.weight", model_type)
                gathered = spec is not None and spec.partition_type == PartitionType.COLUMN and spec.gather_output
            if gathered:
                self._tied_gathered_column_module_names.update((name, *tied))
                logger.warning(f"AutoTP: '{name}.weight' is tied to embeddings {tied}; leaving these modules "
                               "replicated to preserve tied weights with gathered output.")

    def _replace_last_linear_module(self, r_module: nn.Module) -> nn.Module:
        """The output head alone, by the linear policies (DeepSpeed's inference path)."""
        self._configure_gathered_column_tie_fallbacks()
        name = next((p for p in self._lm_head_patterns() if hasattr(r_module, p)), None)
        if name is None or name in self._tied_gathered_column_module_names:
            return r_module
        child = getattr(r_module, name)
        if self.linear_policies is not None and type(child) in self.linear_policies:
            setattr(r_module, name, self.linear_policies[type(child)](child, name, self.conv_linear_layer))
        return r_module

    # -- model facts ---------------------------------------------------------------------------
    def _get_model_type(self) -> Optional[str]:
        """The config's model_type, else one read off the model's class name, lower case."""
        config = getattr(self.module, "config", None)
        model_type = getattr(config, "model_type", None) if config is not None else None
        if model_type:
            return str(model_type).lower()
        text = str(type(self.module))
        for pattern in _MODEL_TYPE_FROM_CLASS:
            found = re.search(pattern, text)
            if found:
                return found.group(1).lower()
        return None

    def _group_rank(self) -> int:
        return comm.get_rank(group=self.mp_group) if self.mp_group is not None else 0

    def _sizes(self, total: int, name: Optional[str]) -> List[int]:
        if self.tp_meta is not None:
            return get_shard_size_list(total, self.mp_size, self.tp_meta, name)
        return get_shard_size_list(total, self.mp_size, name)

    # -- embeddings and attributes -------------------------------------------------------------
    def _slice_embedding(self, child: nn.Embedding, name: str, conv_linear_layer: bool = False):
        """A new nn.Embedding holding this rank's columns of the hidden dimension (a fresh,
        trainable parameter, as DeepSpeed's; in the source's dtype, where DeepSpeed's is always
        float32), described for universal checkpoints as a row-parallel split."""
        if getattr(child, "replaced", False):
            return None
        self._refuse_zero3(child, name)
        original_shape = tuple(child.weight.shape)
        sizes = self._sizes(original_shape[1], name)
        block = child.weight.data.split(sizes, dim=1)[self._group_rank()]
        new = nn.Embedding(original_shape[0], block.shape[1], device=get_accelerator().current_device_name(),
                           dtype=child.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(block)
        setattr(new.weight, DS_AUTOTP_UC_META,
                build_restore_meta(partition_type="row", partition_dim=1, logical_shape=original_shape,
                                   output_shape=original_shape, partition_sizes=sizes,
                                   target_partition_shape=tuple(new.weight.shape), original_shape=original_shape))
        setattr(child, "replaced", True)
        return new

    def update_mp_params(self, child: nn.Module, name: Optional[str] = None) -> None:
        """Divide `child`'s head counts and widths as its split weights were divided (same
        layer name, so the same tp_shard rule). A module below which nothing was split, or one
        holding >2-D weights (fused experts, patch embeddings), keeps them whole."""
        if getattr(child, "replaced", False):
            return
        if not any(hasattr(p, DS_AUTOTP_UC_META) for p in child.parameters()):
            setattr(child, "replaced", True)
            return
        own = list(child.parameters(recurse=False))
        if not any(p.dim() >= 3 for p in own):
            own = [p for m in child.children() for p in m.parameters(recurse=False)]
        if any(p.dim() >= 3 for p in own):
            setattr(child, "replaced", True)
            return
        rank = self._group_rank()
        attrs = [a for a in MP_PARAMS if not (a == "embed_dim" and "Yuan" in str(child))]
        for attr in attrs:
            if hasattr(child, attr):
                value = getattr(child, attr)
                if self.tp_meta is not None:
                    local = get_shard_size(value, self.mp_size, self.tp_meta, name, rank=rank)
                else:
                    local = get_shard_size(value, self.mp_size, name, rank=rank)
                setattr(child, attr, local)
        setattr(child, "replaced", True)

    def register_replicated_grad_hooks(self, model: nn.Module) -> None:
        """Sum over the tensor-parallel group the gradient of every parameter a grad_allreduce
        spec names (a replicated norm applied to local heads gets a partial gradient per rank)."""
        if self.partition_config is None or self.mp_group is None or not self.mp_size or self.mp_size <= 1:
            return
        group = self.mp_group
        model_type = self._get_model_type()
        for pname, param in model.named_parameters():
            spec = self.partition_config.find_matching_spec(pname, model_type)
            if spec is None or not spec.grad_allreduce or getattr(param, "_ds_grad_allreduce_registered", False):
                continue
            param.register_hook(_grad_allreduce_hook(group, pname))
            param._ds_grad_allreduce_registered = True


def _grad_allreduce_hook(group: Any, name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, op=comm.ReduceOp.SUM, group=group, label=f"tp grad all-reduce {name}")
        return grad

    return hook


class _Descend:
    """The walk's answer for a module that is not itself replaced: go into its children."""

    def __repr__(self) -> str:
        return "<descend>"


_DESCEND = _Descend()
