"""DeepSpeed's internal optimizer wrappers, by name only.

DeepSpeed's engine wraps the optimizer in a class per precision and ZeRO stage
(DeepSpeedZeroOptimizer, FP16_Optimizer, ...); code written against DeepSpeed, its own
tests included, imports them to ask `isinstance(engine.optimizer, ...)`. dslaunch's engine
keeps precision and partitioning in its strategy and exposes the plain torch optimizer as
`engine.optimizer`, so these names exist for that question and refuse construction with the
reason. For the concrete wrappers of stages 0-2 (FP16_Optimizer, DeepSpeedZeroOptimizer, ...)
the answer is always no: their internals (flat fp16 groups, bucket state) are not all here.
For DeepSpeed's two base classes (DeepSpeedOptimizer, ZeROOptimizer:
deepspeed.runtime.base_optimizer) and its stage-3 optimizer the answer is the role the engine
gave its optimizer (engine_roles below), as DeepSpeed's engine would have wrapped it, because
what scripts and DeepSpeed's tests use through them (needs_scaler; at stage 3 the flat fp32
partitions and _get_norm_groups) is here.
"""
from __future__ import annotations

import torch


class DeepSpeedInternalOptimizer:
    """A DeepSpeed optimizer wrapper that dslaunch does not build."""

    _replacement = "dslaunch's engine builds the equivalent from the config"

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is DeepSpeed's internal optimizer wrapper, which dslaunch does not "
                        f"provide: {self._replacement}; pass the torch optimizer (or the config's \"optimizer\") to "
                        "deepspeed.initialize")


def internal_optimizer(name: str, replacement: str) -> type:
    """A refusing class named `name` (so messages and reprs read as DeepSpeed's)."""
    return type(name, (DeepSpeedInternalOptimizer,), {"_replacement": replacement, "__doc__":
                                                      f"DeepSpeed's {name}; not built here ({replacement})."})


# The wrappers scripts import by DeepSpeed's module paths (compat/paths.py names them):
# deepspeed.runtime.fp16.fused_optimizer, .fp16.unfused_optimizer, .zero.stage_1_and_2.
FP16_Optimizer = internal_optimizer("FP16_Optimizer", "fp16 training is set by \"fp16\" in the config")
FP16_UnfusedOptimizer = internal_optimizer("FP16_UnfusedOptimizer", "fp16 training is set by \"fp16\" in the config")
# deepspeed.runtime.bf16_optimizer: bf16 here is the engine's precision strategy around the
# plain torch optimizer, so `isinstance(engine.optimizer, BF16_Optimizer)` is False
BF16_Optimizer = internal_optimizer(
    "BF16_Optimizer", "bf16 with fp32 master weights is set by \"bf16\": {\"enabled\": true} in the config")
DeepSpeedZeroOptimizer = internal_optimizer(
    "DeepSpeedZeroOptimizer", "ZeRO stages 1 and 2 are set by \"zero_optimization.stage\" in the config")


class _EngineRole(type):
    """isinstance(obj, cls) holds when an engine drives obj in the role named cls.__name__
    (the engine's optimizer carries the names of DeepSpeed's base classes its wrapper has)."""

    def __instancecheck__(cls, obj) -> bool:
        return cls.__name__ in getattr(obj, ROLES_ATTRIBUTE, ()) or super().__instancecheck__(obj)


ROLES_ATTRIBUTE = "_deepspeed_roles"
# deepspeed.runtime.base_optimizer: every wrapper DeepSpeed's engine builds is a DeepSpeedOptimizer,
# and the ZeRO ones (stages 1-3, and BF16_Optimizer) are also ZeROOptimizers
DeepSpeedOptimizer = _EngineRole("DeepSpeedOptimizer", (DeepSpeedInternalOptimizer,), {
    "_replacement": "deepspeed.initialize's engine.optimizer answers isinstance for it where DeepSpeed's wrapper would",
    "__doc__": "DeepSpeed's base of its optimizer wrappers: isinstance holds for an fp16/bf16 or ZeRO engine's optimizer."})
ZeROOptimizer = _EngineRole("ZeROOptimizer", (DeepSpeedOptimizer,), {
    "__doc__": "DeepSpeed's base of its ZeRO optimizers: isinstance holds for the optimizer of an engine at ZeRO 1-3."})


# deepspeed.runtime.zero.stage3's optimizer: what its tests read of it is published on a stage-3
# engine's optimizer (fp16_groups, fp32_partitioned_groups_flat, _get_norm_groups, _global_grad_norm)
DeepSpeedZeroOptimizer_Stage3 = _EngineRole("DeepSpeedZeroOptimizer_Stage3", (ZeROOptimizer,), {
    "_replacement": "ZeRO stage 3 is set by \"zero_optimization.stage\" in the config",
    "__doc__": "DeepSpeed's ZeRO-3 optimizer: isinstance holds for the optimizer of an engine at ZeRO 3."})


def engine_roles(zero_stage: int, compute_dtype, pipeline: bool) -> frozenset:
    """The base classes of the wrapper DeepSpeed 0.19.8's engine would return as engine.optimizer:
    a ZeRO optimizer at stages 1-3; at stage 0, BF16_Optimizer (a ZeROOptimizer) for bf16 under
    its pipeline engine, FP16_Optimizer (a DeepSpeedOptimizer) for fp16 or bf16 otherwise, and
    the client's own optimizer for fp32; at stage 3 also DeepSpeedZeroOptimizer_Stage3."""
    if zero_stage == 3:
        return frozenset({"DeepSpeedOptimizer", "ZeROOptimizer", "DeepSpeedZeroOptimizer_Stage3"})
    if zero_stage >= 1 or (pipeline and compute_dtype == torch.bfloat16):
        return frozenset({"DeepSpeedOptimizer", "ZeROOptimizer"})
    return frozenset({"DeepSpeedOptimizer"}) if compute_dtype != torch.float32 else frozenset()
