"""The torch.optim.Optimizer shell shared by CPUAdam, CPULion and CPUAdagrad.

Each subclass says how to make a parameter's per-element state (`_init_state`) and how to
update a list of parameters that share a step count in one op call (`_update`); this class
does the rest the same way for all three: state creation, step counting in a float32
tensor as torch does (so state_dicts move to and from torch's optimizers), one op call per
distinct step count (normally one per group), the parameter checks, and the fused CPU
step that ZeRO offload asks for (fused_step.py).

Parameters are checked when stepped, not when the optimizer is built: the engine builds
the optimizer over the model's (maybe bf16, maybe GPU) parameters and then hands it fp32
host masters, as DeepSpeed does with DeepSpeedCPUAdam.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .fused_step import FusedCPUStep, FusedStepUnavailable, KernelUnavailable
from .loader import LazyOp


class CPUOptimizer(torch.optim.Optimizer):
    op: LazyOp  # the compiled op (process-wide default unless a subclass instance overrides it)
    label: str  # "CPU Adam"

    def _init_state(self, p: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def _update(self, params: List[torch.Tensor], grads: List[torch.Tensor], states: List[dict], step: int,
                group: dict) -> None:
        raise NotImplementedError

    def _unsupported(self, group: dict) -> str:
        """Why this group cannot be stepped by the kernel in offload ("" when it can)."""
        return ""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            todo: List[torch.Tensor] = []
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise TypeError(f"{type(self).__name__}: parameter {i} is {p.dtype} on {p.device}; it steps fp32 "
                                    "CPU master parameters (ZeRO offload_optimizer keeps them; keep a bf16/fp16 "
                                    "device copy and use the op's copy_out)")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state.update(self._init_state(p, group))
                todo.append(p)
            if not todo:
                continue
            steps = [self.state[p]["step"] for p in todo]
            torch._foreach_add_(steps, 1.0)
            by_step: Dict[int, List[torch.Tensor]] = {}
            for p, s in zip(todo, torch.stack(steps).tolist()):
                by_step.setdefault(int(s), []).append(p)
            for step, ps in by_step.items():
                self._update(ps, [p.grad for p in ps], [self.state[p] for p in ps], step, group)
        return loss

    def describe(self) -> str:
        """What steps the parameters (the engine's start-up line shows it)."""
        if self.op.load():
            return f"dslaunch {self.label} ({self.op.built.isa})"
        return f"torch (the dslaunch {self.label} op is unavailable)"

    def fused_cpu_step(self) -> FusedCPUStep:
        """ZeRO offload's way in: the same op, one flat tensor (or slice) at a time."""
        for group in self.param_groups:
            why = self._unsupported(group)
            if why:
                raise FusedStepUnavailable(why)
        if not self.op.load():
            raise KernelUnavailable(f"the dslaunch {self.label} op is unavailable: {self.op.error}")
        isa = self.op.built.isa if self.op.built is not None else "?"

        def step(p, g, state, count, group):
            self._update([p], [g], [state], count, group)

        return FusedCPUStep(f"dslaunch {self.label} ({isa})", self._init_state, step)
