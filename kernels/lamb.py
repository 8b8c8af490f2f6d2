"""LAMB in torch ops, on any device, with DeepSpeed's FusedLamb semantics.

LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), per parameter tensor:
  m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g^2
  u = m / (sqrt(v) + eps) + wd*p            (eps_inside_sqrt: m / sqrt(v + eps) + wd*p)
  trust = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
  p -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * trust * u   (without the corrections: lr)
as DeepSpeed's CUDA kernel computes it (the bias corrections scale the step, not u).
States are fp32 whatever the parameter dtype; the last step's trust ratios are kept for
`get_lamb_coeffs()`, as FusedLamb does.
"""
from __future__ import annotations

from typing import List, Tuple

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False):
        if amsgrad:
            raise ValueError("Lamb: there is no AMSGrad variant of LAMB (amsgrad must be false)")
        if max_grad_norm:
            raise ValueError("Lamb: max_grad_norm is not an optimizer option here; clip with the config's "
                             "\"gradient_clipping\" (as DeepSpeed requires)")
        if lr < 0 or eps < 0 or weight_decay < 0 or not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need lr, eps, weight_decay >= 0 and 0 <= min_coeff <= max_coeff "
                             f"(got {lr}, {eps}, {weight_decay}, {min_coeff}, {max_coeff})")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.lamb_coeffs: List[torch.Tensor] = []

    def get_lamb_coeffs(self) -> List[float]:
        return [float(c) for c in self.lamb_coeffs]

    def describe(self) -> str:
        return "torch ops (LAMB)"

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                g = p.grad.float()
                w = p.detach().float()
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
                update = (m / denom).add_(w, alpha=group["weight_decay"])
                w_norm, u_norm = w.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0),
                                    (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]),
                                    torch.ones_like(w_norm))
                step_size = group["lr"]
                if group["bias_correction"]:
                    step_size *= (1.0 - beta2 ** t) ** 0.5 / (1.0 - beta1 ** t)
                w.sub_(update * trust, alpha=step_size)
                if w.data_ptr() != p.data_ptr():
                    p.copy_(w)
                self.lamb_coeffs.append(trust)
        return loss
