"""`deepspeed.runtime.fp16.unfused_optimizer`: DeepSpeed's unfused fp16 optimizer wrapper,
named for isinstance checks only (see runtime/internals.py)."""
from ..core.internals import internal_optimizer

FP16_UnfusedOptimizer = internal_optimizer("FP16_UnfusedOptimizer", "fp16 training is set by \"fp16\" in the config")

__all__ = ["FP16_UnfusedOptimizer"]
