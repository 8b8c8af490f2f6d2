"""`deepspeed.runtime.fp16.fused_optimizer`: DeepSpeed's fp16 optimizer wrapper, named for
isinstance checks only (see runtime/internals.py)."""
from ..core.internals import internal_optimizer

FP16_Optimizer = internal_optimizer("FP16_Optimizer", "fp16 training is set by \"fp16\" in the config")

__all__ = ["FP16_Optimizer"]
