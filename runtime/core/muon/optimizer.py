"""`MuonWithAuxAdam`: DeepSpeed's Muon optimizer object (`"optimizer": {"type": "Muon"}`).

Its param groups carry `use_muon`. A Muon group (hidden 2-D weights) keeps one state
tensor per parameter, `momentum_buffer`, and steps

    p <- p * (1 - lr * weight_decay) - lr * update

where `update` is the orthogonalised Nesterov momentum (newton_schulz.py). An Adam group
(embeddings, norms, biases, the LM head) is stepped by an auxiliary Adam(W) that shares
this optimizer's group dicts and state, so one state_dict holds both halves, and an LR
scheduler writing "lr" into the groups reaches both.

Where the update is computed depends on who holds whole matrices:
- stage 0 (and a script stepping the optimizer itself): the parameters are the whole
  weights, so step() runs the momentum and Newton-Schulz here, batching same-shaped
  matrices into one iteration;
- ZeRO stages 1-3 hold flat partitions: the strategy computes the update on whole
  matrices before the step (sharded.py) and leaves it in each partition's .grad; it sets
  `updates_given`, and step() then only applies lr and weight decay. The momentum is then
  partition-shaped state of the Muon group's flat master, as Adam's moments are.

The auxiliary Adam is picked as DeepSpeed picks it: torch's Adam/AdamW with `torch_adam`,
the CPU kernel under offload or on CPU parameters, FusedAdam on CUDA (runtime/optim.py).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional

import torch

from . import newton_schulz as ns

# DeepSpeed's defaults for each half when neither the config nor the group sets them.
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class MuonWithAuxAdam(torch.optim.Optimizer):
    """DeepSpeed's class name, so `type(engine.optimizer).__name__` reads as there."""

    def __init__(self, param_groups: List[Dict[str, Any]], adam_optimizer: Optional[Callable] = None,
                 adam_optimizer_kwargs: Optional[Dict[str, Any]] = None, adam_w_mode: bool = True,
                 fallback_to_inline: bool = False):
        """DeepSpeed's signature: `adam_optimizer(adam_groups, **adam_optimizer_kwargs)` builds the
        auxiliary Adam; without one (or, with fallback_to_inline, when building it raises
        RuntimeError) the Adam groups are stepped inline with torch ops."""
        groups = []
        for i, group in enumerate(param_groups):
            if "use_muon" not in group:
                raise ValueError(f"MuonWithAuxAdam: param group {i} has no use_muon key")
            group = dict(group)
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            for key, value in defaults.items():
                group.setdefault(key, value)
            if group["use_muon"]:
                if group["ns_method"] not in ns.NS_METHODS:
                    raise ValueError(f"MuonWithAuxAdam: ns_method must be one of {', '.join(ns.NS_METHODS)}, "
                                     f"got {group['ns_method']!r}")
                # largest first, as DeepSpeed orders them (ZeRO lays the group out in this order)
                group["params"] = sorted(group["params"], key=lambda p: p.size(), reverse=True)
            groups.append(group)
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode
        self.updates_given = False  # set by a ZeRO strategy: a Muon group's .grad is its update
        self.adam = None
        adam_groups = self._adam_groups()
        if adam_groups and adam_optimizer is not None:
            try:
                self.adam = adam_optimizer(adam_groups, **(adam_optimizer_kwargs or {}))
            except RuntimeError as exc:
                if not fallback_to_inline:
                    raise
                warnings.warn(f"MuonWithAuxAdam: {getattr(adam_optimizer, '__name__', adam_optimizer)} could not be "
                              f"built ({exc}); its groups are stepped inline with torch ops")
            if self.adam is not None:
                self._link_adam()

    def _adam_groups(self) -> List[Dict[str, Any]]:
        return [g for g in self.param_groups if not g["use_muon"]]

    def _link_adam(self) -> None:
        """The auxiliary Adam steps this optimizer's own Adam group dicts and state."""
        for group in self._adam_groups():
            for key, value in self.adam.defaults.items():
                group.setdefault(key, value)
        self.adam.param_groups = self._adam_groups()
        self.adam.state = self.state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.adam is not None:  # torch made new group dicts and a new state
            self._link_adam()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"] and group["params"]:
                if self.updates_given:
                    self._apply_given(group)
                else:
                    self._muon_whole(group)
        adam_groups = self._adam_groups()
        for group in adam_groups:
            for p in group["params"]:
                if p.grad is None:  # DeepSpeed steps every parameter, a missing gradient as zeros
                    p.grad = torch.zeros_like(p)
        if self.adam is not None:
            self.adam.param_groups = adam_groups  # the same dicts; a ZeRO stage may have swapped their params
            self.adam.step()
        else:
            for group in adam_groups:
                self._adam_inline(group)
        return loss

    def _adam_inline(self, group: Dict[str, Any]) -> None:
        """Adam(W) in torch ops (no auxiliary optimizer): bias-corrected moments, decoupled
        weight decay in AdamW mode, L2 added to the gradient otherwise."""
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            grad = p.grad if self.adam_w_mode else p.grad.add(p, alpha=group["weight_decay"])
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
            update = state["exp_avg"] / (1 - beta1 ** step) / denom
            if self.adam_w_mode:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"])

    @staticmethod
    def _apply(params: List[torch.Tensor], updates: List[torch.Tensor], group: Dict[str, Any]) -> None:
        decay = 1 - group["lr"] * group["weight_decay"]
        if decay != 1:
            torch._foreach_mul_(params, decay)
        torch._foreach_add_(params, updates, alpha=-group["lr"])

    def _apply_given(self, group: Dict[str, Any]) -> None:
        """ZeRO: the flat partition's gradient is already the (scaled, clipped) update."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if "step" in state:
                state["step"] += 1
        if params:
            self._apply(params, [p.grad for p in params], group)

    def _muon_whole(self, group: Dict[str, Any]) -> None:
        """Momentum, Nesterov and Newton-Schulz on whole weights, one batch per shape."""
        params = group["params"]
        beta = group["momentum"]
        by_shape: Dict[tuple, List[torch.Tensor]] = {}
        for p in params:
            by_shape.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
        order, blends = [], []
        for (shape, _, _), ps in by_shape.items():
            grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
            moms = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in ps]
            momentum = torch.stack(moms)
            # a matrix with a non-finite gradient keeps its momentum (its update is then non-finite,
            # which the step applies or the loss scaler skips, as DeepSpeed's)
            keep = ns.finite_rows(grads).view(-1, *([1] * len(shape)))
            momentum = torch.where(keep, momentum.lerp(grads, 1 - beta), momentum)
            torch._foreach_copy_(moms, list(momentum.unbind(0)))
            blend = torch.lerp(grads, momentum, beta)
            order += ps
            blends += list(blend.unbind(0))
        updates = ns.orthogonalize(blends, [p.shape for p in order], group["ns_method"], order[0].dtype)
        self._apply(order, [u.view_as(p) for u, p in zip(updates, order)], group)

    # -- ZeRO offload: the fused CPU step protocol (dslaunch.kernels.fused_step) --------------------
    def fused_cpu_step(self):
        from dslaunch.kernels.fused_step import FusedCPUStep, FusedStepUnavailable, fused_cpu_step

        # offload is ZeRO's: the Muon groups' gradients are the updates the stage computed
        adam = fused_cpu_step(self.adam) if self.adam is not None else None

        if adam is None and self._adam_groups():
            raise FusedStepUnavailable("its Adam groups are stepped inline with torch ops")

        def init_state(master, group):
            if group["use_muon"]:
                return {"momentum_buffer": torch.zeros_like(master)}
            return adam.init_state(master, group)

        def step(master, grad, state, count, group):
            if group["use_muon"]:
                decay = 1 - group["lr"] * group["weight_decay"]
                if decay != 1:
                    master.mul_(decay)
                master.add_(grad.to(master.dtype), alpha=-group["lr"])
            else:
                adam.step(master, grad, state, count, group)

        kernel = "Muon updates" + (f" + {adam.kernel}" if adam is not None else "")
        return FusedCPUStep(kernel=kernel, init_state=init_state, step=step)
