"""`deepspeed.ops.adam`: DeepSpeedCPUAdam (the C++ SIMD CPU kernel) and FusedAdam (CUDA)."""
from __future__ import annotations

from dslaunch.kernels.cpu_adam import CPUAdam
from dslaunch.kernels.fused_adam import FusedAdam as _FusedAdam

from ._common import SetGradNone, fp32_states_only

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedCPUAdam(CPUAdam):
    """Adam (adamw_mode=False) or AdamW on fp32 CPU master parameters, DeepSpeed's signature.
    Unlike DeepSpeed's, amsgrad=True works."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        fp32_states_only("DeepSpeedCPUAdam", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = True


class FusedAdam(SetGradNone, _FusedAdam):
    """Multi-tensor Adam/AdamW on CUDA parameters, DeepSpeed's signature."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode, bias_correction=bias_correction)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
