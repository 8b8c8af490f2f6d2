"""The torch.optim.Optimizer shell shared by CPUAdam, CPULion and CPUAdagrad.

Each subclass says how to make a parameter's per-element state (`_init_state`, its keys
`_state_keys`) and how to
update a list of parameters in one op call (`_update`, given an int count or the
parameters' step tensors); this class does the rest the same way for all three: state
creation, step counting in a float32 tensor as torch does (so state_dicts move to and from
torch's optimizers), one op call per group (the op groups parameters by count itself, so
no count leaves the tensors and torch.compile traces step() without a graph break), the
parameter checks, and the fused CPU step that ZeRO offload asks for (fused_step.py).

Parameters are checked when stepped, not when the optimizer is built: the engine builds
the optimizer over the model's (maybe bf16, maybe GPU) parameters and then hands it fp32
host masters, as DeepSpeed does with DeepSpeedCPUAdam.
"""
from __future__ import annotations

from typing import Dict, List, Tuple, Union

import torch

from .fused_step import FusedCPUStep, FusedStepUnavailable, KernelUnavailable
from .loader import LazyOp


class CPUOptimizer(torch.optim.Optimizer):
    op: LazyOp  # the compiled op (process-wide default unless a subclass instance overrides it)
    label: str  # "CPU Adam"

    def _init_state(self, p: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def _state_keys(self, group: dict) -> Tuple[str, ...]:
        """The per-element state `_init_state` makes, in the order `_update` wants it."""
        raise NotImplementedError

    def _update(self, params: List[torch.Tensor], grads: List[torch.Tensor], states: Dict[str, List[torch.Tensor]],
                step: Union[int, List[torch.Tensor]], group: dict) -> None:
        raise NotImplementedError

    def _unsupported(self, group: dict) -> str:
        """Why this group cannot be stepped by the kernel in offload ("" when it can)."""
        return ""

    def _init_group(self, group: dict, params: List[torch.Tensor], grads: List[torch.Tensor],
                    steps: List[torch.Tensor], *states: List[torch.Tensor]) -> bool:
        """Fill the lists with the group's parameters that have gradients, their gradients,
        step tensors and per-element states (one list per `_state_keys` key), making the
        state on first sight; True when there is something to step.

        (The name and the fill-the-lists form are torch's: torch.compile runs an optimizer's
        `_init_group` eagerly while tracing, as for torch's own optimizers, so state creation
        and these checks never enter the graph.)"""
        keys = self._state_keys(group)
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
            params.append(p)
            grads.append(p.grad)
            steps.append(state["step"])
            for key, lst in zip(keys, states):
                lst.append(state[key])
        return bool(params)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, steps = [], [], []
            keys = self._state_keys(group)
            states = tuple([] for _ in keys)
            self._init_group(group, params, grads, steps, *states)
            if not params:
                continue
            # One op call per group: the op reads each parameter's count from its step
            # tensor and runs the kernel once per distinct count (normally one).
            torch._foreach_add_(steps, 1.0)
            self._update(params, grads, dict(zip(keys, states)), steps, group)
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
            self._update([p], [g], {k: [state[k]] for k in self._state_keys(group)}, count, group)

        return FusedCPUStep(f"dslaunch {self.label} ({isa})", self._init_state, step)
