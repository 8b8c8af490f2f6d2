"""DeepSpeed's internal optimizer wrappers, by name only.

DeepSpeed's engine wraps the optimizer in a class per precision and ZeRO stage
(DeepSpeedZeroOptimizer, FP16_Optimizer, ...); code written against DeepSpeed, its own
tests included, imports them to ask `isinstance(engine.optimizer, ...)`. dslaunch's engine
keeps precision and partitioning in its strategy and exposes the plain torch optimizer as
`engine.optimizer`, so these names exist for that question (whose answer here is always
no) and refuse construction with the reason.
"""
from __future__ import annotations


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
