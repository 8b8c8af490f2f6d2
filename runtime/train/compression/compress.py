"""`init_compression` and `redundancy_clean` (DeepSpeed's deepspeed.compression.compress), and
the schedule the engine steps.

init_compression registers one parametrization per technique and module (masks.py) and leaves
a `CompressionSchedule` on the model; `deepspeed.initialize` finds it and calls
`schedule.update(step)` at step 0 and after every applied optimizer step, as DeepSpeed's
engine did. A plain torch loop calls `compression_schedule(model).update(step)` itself.
redundancy_clean makes the saving real: every technique is brought to its final state, masks
and fake-quant are baked into plain weights, and pruned rows and heads are cut from the layer
and its related modules, so the result is plain torch.nn modules of smaller shapes.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize

from ...core.config import DeepSpeedConfig
from ...core.config.compression import CompressionConfig
from ...core.strict import ConfigError
from .masks import ActivationQuant, ChannelMask, HeadMask, RowBias, RowMask, SparseMask, WeightQuant
from .plan import Target, plan, pruning_steps, stack_of

ATTR = "_dslaunch_compression"


def _config(deepspeed_config) -> CompressionConfig:
    if isinstance(deepspeed_config, CompressionConfig):
        return deepspeed_config
    if not isinstance(deepspeed_config, DeepSpeedConfig):
        deepspeed_config = DeepSpeedConfig.load(deepspeed_config)
    return deepspeed_config.compression_training


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def _check_mpu(mpu) -> None:
    if mpu is None:
        return
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        size = getattr(mpu, name, None)
        if size is not None and size() > 1:
            raise ConfigError("compression_training: tensor-parallel layers are not supported (masks are computed "
                              "on whole weights); compress with tensor parallel size 1")


class _Part:
    """One registered technique on one module, with its schedule."""

    def __init__(self, target: Target, module: nn.Module, technique: nn.Module, shared):
        self.target, self.module, self.technique, self.shared = target, module, technique, shared
        self.hook = None  # activation quantization's forward pre-hook
        if target.technique in ("weight_quantization", "activation_quantization"):
            self.steps: List[int] = [shared.schedule_offset]
        else:
            self.steps, _ = pruning_steps(shared, target.params.dense_ratio)

    def original(self) -> torch.Tensor:
        return self.module.parametrizations.weight.original

    def update(self, step: int) -> None:
        t = self.technique
        if isinstance(t, ActivationQuant):
            if step >= self.shared.schedule_offset and not t.is_active():
                t.active.fill_(True)
            return
        if isinstance(t, WeightQuant):
            p = self.target.params
            if step >= self.shared.schedule_offset:
                bits = max(p.target_bits, p.start_bits - (step - self.shared.schedule_offset) // p.quantization_period)
                if int(t.bits) != bits:
                    t.set_bits(bits)
            return
        due = sum(1 for s in self.steps if s <= step)
        if due > int(t.done):
            self._prune(due)

    def finish(self) -> None:
        t = self.technique
        if isinstance(t, ActivationQuant):
            return  # removed by redundancy_clean: the cleaned model computes in floating point
        if isinstance(t, WeightQuant):
            t.set_bits(self.target.params.target_bits)
        elif int(t.done) < len(self.steps):
            self._prune(len(self.steps))

    def _prune(self, done: int) -> None:
        t = self.technique
        with torch.no_grad():
            weight = self.original()
            if isinstance(t, SparseMask) and t.is_active():
                weight = weight * t.current()
            t.prune_to(weight, done)


class CompressionSchedule:
    """The compression state of one model: its config, and each technique on each module."""

    def __init__(self, config: CompressionConfig, parts: List[_Part]):
        self.config = config
        self.parts = parts

    def update(self, step: int) -> None:
        """Bring every technique to its state for training step `step` (0 before the first
        optimizer step). Idempotent: a resumed run's masks come from its checkpoint."""
        for part in self.parts:
            part.update(step)

    def finish(self) -> None:
        for part in self.parts:
            part.finish()


def compression_schedule(model: nn.Module) -> Optional[CompressionSchedule]:
    """The schedule init_compression left on `model`, or None."""
    return getattr(_unwrap(model), ATTR, None)


def init_compression(model: nn.Module, deepspeed_config, teacher_model: Optional[nn.Module] = None, mpu=None):
    """Prepare `model` for compression-aware training by `deepspeed_config`'s
    compression_training section (a config dict, a JSON/YAML path or a DeepSpeedConfig).
    Call it before deepspeed.initialize. Returns the model. teacher_model is read by
    layer_reduction (without it the model is its own teacher)."""
    config = _config(deepspeed_config)
    _check_mpu(mpu)
    c_model = _unwrap(model)
    if compression_schedule(c_model) is not None:
        raise ConfigError("init_compression: this model is already prepared for compression; call it once")
    if not config.enabled:
        raise ConfigError("init_compression: compression_training enables no technique (set "
                          "shared_parameters.enabled true in one)")
    if config.layer_reduction.enabled:
        reduce_layers(c_model, config, teacher_model)
    targets = plan(c_model, config)
    modules = dict(c_model.named_modules())
    parts: List[_Part] = []
    for target in targets:
        module = modules[target.name]
        shared = config.techniques[target.technique].shared_parameters
        weight = module.weight
        if target.technique == "activation_quantization":
            technique = ActivationQuant(target.params.bits, shared.quantization_type == "symmetric",
                                        shared.range_calibration == "static", isinstance(module, nn.Conv2d))
            technique.to(device=weight.device)
            module.add_module("activation_quantizer", technique)
            part = _Part(target, module, technique, shared)
            part.hook = module.register_forward_pre_hook(technique.hook)
            parts.append(part)
            continue
        if target.technique == "weight_quantization":
            groups = weight.shape[0] if isinstance(module, nn.Embedding) else shared.quantize_groups
            technique = WeightQuant(weight, groups, shared.quantization_type == "symmetric")
        else:
            _, ratios = pruning_steps(shared, target.params.dense_ratio)
            if target.technique == "sparse_pruning":
                technique = SparseMask(weight, shared.method, ratios)
            elif target.technique == "row_pruning":
                technique = RowMask(weight, shared.method, ratios)
            elif target.technique == "channel_pruning":
                technique = ChannelMask(weight, shared.method, ratios)
            else:
                technique = HeadMask(weight, shared.num_heads, ratios)
        technique.to(device=weight.device)
        if getattr(technique, "ranked_at_init", False):
            # DeepSpeed's l1 mask: the weights as init_compression finds them (not quantized or masked)
            raw = module.parametrizations.weight.original if parametrize.is_parametrized(module, "weight") else weight
            technique.rank_now(raw)
        parametrize.register_parametrization(module, "weight", technique)
        if isinstance(technique, RowMask) and module.bias is not None:
            parametrize.register_parametrization(module, "bias", RowBias(technique))
        parts.append(_Part(target, module, technique, shared))
    setattr(c_model, ATTR, CompressionSchedule(config, parts))
    return model


def reduce_layers(model: nn.Module, config: CompressionConfig, teacher: Optional[nn.Module]) -> None:
    """layer_reduction: layer i of the stack becomes a copy of the teacher's layer
    teacher_layer[i] (state_dict: parameters and buffers), other_module_name modules are copied
    from the teacher, and the stack is cut to keep_number_layer layers."""
    lr = config.layer_reduction
    path = "compression_training.layer_reduction"
    stack = stack_of(model, lr.module_name_prefix, f"{path}.module_name_prefix")
    source = stack_of(teacher if teacher is not None else model, lr.module_name_prefix,
                      f"{path}.module_name_prefix (teacher)")
    if max(lr.teacher_layer) >= len(source):
        raise ConfigError(f"{path}.teacher_layer: {max(lr.teacher_layer)} is out of range: the teacher's "
                          f"{lr.module_name_prefix} has {len(source)} layers")
    if len(stack) < lr.keep_number_layer:
        raise ConfigError(f"{path}.keep_number_layer: {lr.keep_number_layer} layers, but the model's "
                          f"{lr.module_name_prefix} has {len(stack)}")
    states = [{k: v.detach().clone() for k, v in source[t].state_dict().items()} for t in lr.teacher_layer]
    pairs = [(stack[i], state, f"layer {lr.teacher_layer[i]}") for i, state in enumerate(states)]
    if teacher is not None:
        modules, theirs = dict(model.named_modules()), dict(teacher.named_modules())
        for name in lr.other_module_name:
            if name not in modules or name not in theirs:
                raise ConfigError(f"{path}.other_module_name: {name!r} is not a module of the model and the teacher")
            pairs.append((modules[name], theirs[name].state_dict(), name))
    elif lr.other_module_name:
        raise ConfigError(f"{path}.other_module_name: copies modules from a teacher; pass teacher_model= or "
                          "remove it")
    with torch.no_grad():
        for module, state, what in pairs:
            mine = module.state_dict()
            if sorted(mine) != sorted(state) or any(mine[k].shape != state[k].shape for k in mine):
                raise ConfigError(f"{path}: the teacher's {what} does not fit the model's (other parameters or "
                                  "shapes)")
            module.load_state_dict(state)
    del stack[lr.keep_number_layer:]


def _cut_rows(module: nn.Module, keep: torch.Tensor) -> None:
    """Keep output rows (Linear) or channels (Conv2d) `keep`."""
    module.weight = nn.Parameter(module.weight.detach()[keep].clone())
    if module.bias is not None:
        module.bias = nn.Parameter(module.bias.detach()[keep].clone())
    if isinstance(module, nn.Conv2d):
        module.out_channels = module.weight.shape[0]
    else:
        module.out_features = module.weight.shape[0]


def _cut_columns(module: nn.Module, keep: torch.Tensor) -> None:
    """Keep inputs `keep`: a Linear's columns, a Conv2d's input channels, a BatchNorm2d's features."""
    if isinstance(module, nn.BatchNorm2d):
        if module.affine:
            module.weight = nn.Parameter(module.weight.detach()[keep].clone())
            module.bias = nn.Parameter(module.bias.detach()[keep].clone())
        if module.track_running_stats:
            module.running_mean = module.running_mean[keep].clone()
            module.running_var = module.running_var[keep].clone()
        module.num_features = int(keep.sum())
        return
    module.weight = nn.Parameter(module.weight.detach()[:, keep].clone())
    if isinstance(module, nn.Conv2d):
        module.in_channels = module.weight.shape[1]
    else:
        module.in_features = module.weight.shape[1]


def redundancy_clean(model: nn.Module, deepspeed_config, mpu=None):
    """Make the compression real: final masks and bit widths, baked into plain weights; pruned
    rows and channels (with the related modules' inputs) and heads (with the related q/k/v
    output rows) cut out; activation quantization removed (its fake-quant is a training-time
    simulation). The model is left with plain torch.nn layers. Returns it."""
    config = _config(deepspeed_config)
    _check_mpu(mpu)
    c_model = _unwrap(model)
    schedule = compression_schedule(c_model)
    if schedule is None:
        raise ConfigError("redundancy_clean: this model was not prepared by init_compression")
    if config != schedule.config:
        raise ConfigError("redundancy_clean: compression_training differs from the config init_compression used; "
                          "pass the same config")
    schedule.finish()
    cuts: List[Dict[str, Any]] = []
    with torch.no_grad():
        for part in schedule.parts:
            t = part.technique
            if isinstance(t, (RowMask, HeadMask)) and part.target.related:  # ChannelMask is a RowMask
                cuts.append({"part": part, "keep": t.current().detach().reshape(-1) > 0.5})
        for part in schedule.parts:
            if part.hook is not None:
                part.hook.remove()
                del part.module.activation_quantizer
        for module in c_model.modules():
            if parametrize.is_parametrized(module):
                for name in list(module.parametrizations.keys()):
                    parametrize.remove_parametrizations(module, name, leave_parametrized=True)
        modules = dict(c_model.named_modules())
        for cut in cuts:
            part, keep = cut["part"], cut["keep"]
            module = part.module
            if isinstance(part.technique, RowMask):
                _cut_rows(module, keep)
                for rel in part.target.related:
                    _cut_columns(modules[rel], keep)
            else:
                heads = part.technique.num_heads
                cols = keep.repeat_interleave(module.in_features // heads)
                _cut_columns(module, cols)
                for rel in part.target.related:
                    _cut_rows(modules[rel], cols)
    delattr(c_model, ATTR)
    return model
