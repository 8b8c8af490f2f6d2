"""`deepspeed.ops.lion`: DeepSpeedCPULion (the C++ SIMD CPU kernel) and FusedLion."""
from __future__ import annotations

from dslaunch.kernels.cpu_lion import CPULion
from dslaunch.kernels.lion import Lion

from ._common import SetGradNone

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class DeepSpeedCPULion(CPULion):
    """Lion on CPU parameters, DeepSpeed's signature: bf16/fp16 parameters are stepped with
    fp32 maths and rounded back, their momentum fp32 unless fp32_optimizer_states=False keeps
    it in the parameter's dtype (as DeepSpeed's op does)."""

    low_precision_params = True

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)


class FusedLion(SetGradNone, Lion):
    """Lion on any device, DeepSpeed's signature. Implemented with torch foreach ops (one
    launch per op over all tensors), not a hand-written CUDA kernel."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none
