"""`deepspeed.ops.adagrad`: DeepSpeedCPUAdagrad (the C++ SIMD CPU kernel)."""
from __future__ import annotations

from dslaunch.kernels.cpu_adagrad import CPUAdagrad

from ._common import fp32_states_only

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(CPUAdagrad):
    """torch.optim.Adagrad's update on fp32 CPU master parameters, DeepSpeed's signature."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad: Adagrad has no AMSGrad variant (amsgrad must be False)")
        fp32_states_only("DeepSpeedCPUAdagrad", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
        self.fp32_optimizer_states = True
