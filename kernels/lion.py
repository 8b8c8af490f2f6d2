"""Lion in torch ops, on any device: the optimizer the engine uses for "Lion" when the
step does not run on the CPU kernel (GPU training without offload), the reference maths
the CPU kernel is tested against, and its fallback.

Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), with decoupled
weight decay and torch.sign (a zero direction leaves the parameter alone):
  c = beta1*m + (1-beta1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = beta2*m + (1-beta2)*g
"""
from __future__ import annotations

from typing import List, Tuple

import torch


def lion_update(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor], lr: float,
                beta1: float, beta2: float, weight_decay: float) -> None:
    """One step over lists of tensors (foreach ops: one kernel launch per op on a GPU)."""
    if not params:
        return
    direction = torch._foreach_mul(exp_avgs, beta1)
    torch._foreach_add_(direction, grads, alpha=1.0 - beta1)
    direction = [d.sign_() for d in direction]
    if weight_decay:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_mul_(exp_avgs, beta2)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)


class Lion(torch.optim.Optimizer):
    """Lion over parameters of any device and dtype (states in the parameter's dtype, as
    the torch reference implementations keep them)."""

    def __init__(self, params, lr: float = 1e-4, betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"Lion: lr and weight_decay must be >= 0 (got {lr}, {weight_decay})")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"Lion: betas must lie in [0, 1], got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def describe(self) -> str:
        return "torch foreach ops (Lion)"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps, gs, ms = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                ps.append(p)
                gs.append(p.grad)
                ms.append(state["exp_avg"])
            beta1, beta2 = group["betas"]
            lion_update(ps, gs, ms, group["lr"], beta1, beta2, group["weight_decay"])
        return loss
