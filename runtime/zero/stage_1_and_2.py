"""`deepspeed.runtime.zero.stage_1_and_2`: DeepSpeed's ZeRO-1/2 optimizer wrapper, named for
isinstance checks only (see runtime/internals.py); ZeRO-1/2 here is stage12.py's strategy."""
from ..core.internals import internal_optimizer

DeepSpeedZeroOptimizer = internal_optimizer(
    "DeepSpeedZeroOptimizer", "ZeRO stages 1 and 2 are set by \"zero_optimization.stage\" in the config")

__all__ = ["DeepSpeedZeroOptimizer"]
