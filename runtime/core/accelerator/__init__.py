"""`deepspeed.accelerator`: get_accelerator() and friends. The implementation sits in
real_accelerator.py, where DeepSpeed keeps it, because scripts import it from there too
(`from deepspeed.accelerator.real_accelerator import get_accelerator`)."""
from .real_accelerator import (
    SUPPORTED_ACCELERATOR_LIST, CPU_Accelerator, DeepSpeedAccelerator, get_accelerator, is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "set_accelerator", "is_current_accelerator_supported",
           "SUPPORTED_ACCELERATOR_LIST", "CPU_Accelerator"]
