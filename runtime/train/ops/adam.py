"""`deepspeed.ops.adam`: DeepSpeedCPUAdam (the C++ SIMD CPU kernel) and FusedAdam (CUDA, or the
CPU kernel for CPU parameters)."""
from __future__ import annotations

from typing import Hashable

import torch

from dslaunch.kernels.cpu_adam import CPUAdam, adam_undo_step
from dslaunch.kernels.fused_adam import FusedAdam as _FusedAdam

from ._common import SetGradNone

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedCPUAdam(CPUAdam):
    """Adam (adamw_mode=False) or AdamW on CPU parameters, DeepSpeed's signature. Unlike
    DeepSpeed's, amsgrad=True works.

    As DeepSpeed's op does, bf16/fp16 parameters are stepped with fp32 maths and rounded back,
    their moments fp32 unless fp32_optimizer_states=False keeps them in the parameter's dtype
    (see dslaunch.kernels.cpu_optimizer). `step_subgroup` / `rollback_subgroup` are DeepSpeed's
    ZeRO-3 offload API: one state per sub-group id instead of per parameter."""

    low_precision_params = True

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode, bias_correction=bias_correction)
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = bool(fp32_optimizer_states)

    def _subgroup_param(self, sub_group_id: Hashable, what: str):
        """The one parameter with a gradient that a sub-group call steps, and its group."""
        found = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if len(found) != 1:
            raise ValueError(f"DeepSpeedCPUAdam.{what}({sub_group_id!r}): a sub-group is one flat parameter (ZeRO-3's "
                             f"partition), but {len(found)} parameters have gradients")
        return found[0]

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: Hashable, closure=None):
        """Step the one parameter that has a gradient (ZeRO-3 offload points param_groups at
        sub-group `subgroup_id`'s flat partition) with the state kept under `subgroup_id`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        p, group = self._subgroup_param(subgroup_id, "step_subgroup")
        self._step_converted(group, [(p, subgroup_id)])
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: Hashable, closure=None):
        """Undo the last step_subgroup(sub_group_id): the parameter, its moments and the step
        count go back to what they were before it (to fp32 rounding; a bf16/fp16 parameter to
        its dtype's). The gradient that step used must still be the parameter's .grad.
        DeepSpeed's op undoes fp32 tensors only (and always in AdamW's form); this undoes
        every dtype in the group's own form, or refuses (amsgrad) with the reason."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state.get(sub_group_id) if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} "
                               "as it has not been initialized.")
        count = int(state["step"])
        if count <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {count}")
        p, group = self._subgroup_param(sub_group_id, "rollback_subgroup")
        work = p.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        keys = self._state_keys(group)
        states = {k: [state[k].to(torch.float32, memory_format=torch.contiguous_format, copy=True)] for k in keys}
        adam_undo_step([work], [p.grad], states, count, group, self.adam_w_mode)
        p.detach().copy_(work)
        for k in keys:
            state[k].copy_(states[k][0])
        state["step"] -= 1
        return loss


class FusedAdam(SetGradNone, _FusedAdam):
    """Multi-tensor Adam/AdamW, DeepSpeed's signature: CUDA parameters by the fused CUDA op,
    CPU parameters by the CPU Adam op (DeepSpeed's CPU accelerator builds its FusedAdam from
    its CPU Adam kernel too). Moments are fp32 for every parameter dtype, where DeepSpeed's
    FusedAdam keeps them in the parameter's."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode, bias_correction=bias_correction, cpu_params=True)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
