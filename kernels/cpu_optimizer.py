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

bf16/fp16 CPU parameters are refused here (an update below the dtype's resolution is lost),
except by subclasses that set `low_precision_params` (DeepSpeed's DeepSpeedCPUAdam, Lion and
Adagrad step them, as DeepSpeed's op does): those are stepped with fp32 maths by the same op,
on an fp32 copy of each parameter that is rounded back (to nearest even, as DeepSpeed's op
stores it). Their moments are fp32, or in the parameter's dtype when `fp32_optimizer_states`
is False (widened for the step, rounded back after). fp32 parameters never take this path.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple, Union

import torch

from .fused_step import FusedCPUStep, FusedStepUnavailable, KernelUnavailable
from .loader import LazyOp


LOW_PRECISION = (torch.bfloat16, torch.float16)


class CPUOptimizer(torch.optim.Optimizer):
    op: LazyOp  # the compiled op (process-wide default unless a subclass instance overrides it)
    label: str  # "CPU Adam"
    # bf16/fp16 CPU parameters are stepped (fp32 maths, rounded back) instead of refused
    low_precision_params = False
    # with low_precision_params: False keeps the moments of a bf16/fp16 parameter in its dtype
    fp32_optimizer_states = True
    # sparse gradients are stepped (by _step_aside, which the subclass then provides) instead of refused
    sparse_gradients = False

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
                    steps: List[torch.Tensor], *states: List[torch.Tensor],
                    low: Optional[List[torch.Tensor]] = None) -> bool:
        """Fill the lists with the group's parameters that have gradients, their gradients,
        step tensors and per-element states (one list per `_state_keys` key), making the
        state on first sight; True when there is something to step.

        (The name and the fill-the-lists form are torch's: torch.compile runs an optimizer's
        `_init_group` eagerly while tracing, as for torch's own optimizers, so state creation
        and these checks never enter the graph.) `low`, where given, receives instead the
        parameters the fast path cannot take but this class steps (bf16/fp16 ones with
        low_precision_params, sparse gradients with sparse_gradients): see _step_aside."""
        keys = self._state_keys(group)
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                if low is None or not self.sparse_gradients:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                low.append(p)
                continue
            if p.device.type != "cpu" or p.dtype != torch.float32:
                if low is not None and self.low_precision_params and p.device.type == "cpu" \
                        and p.dtype in LOW_PRECISION:
                    low.append(p)
                    continue
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
            low = [] if self.low_precision_params or self.sparse_gradients else None
            self._init_group(group, params, grads, steps, *states, low=low)
            if low:
                self._step_aside(group, low)
            if not params:
                continue
            # One op call per group: the op reads each parameter's count from its step
            # tensor and runs the kernel once per distinct count (normally one).
            torch._foreach_add_(steps, 1.0)
            self._update(params, grads, dict(zip(keys, states)), steps, group)
        return loss

    def _step_aside(self, group: dict, params: List[torch.Tensor]) -> None:
        """Step the parameters _init_group set aside (each keyed by itself in self.state)."""
        self._step_converted(group, [(p, p) for p in params])

    def _new_state(self, p: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
        """The state of a parameter on first sight: a float32 step count, and the per-element
        states, contiguous, fp32 (or p's dtype for a bf16/fp16 p without fp32_optimizer_states)."""
        state = {"step": torch.tensor(0.0, dtype=torch.float32)}
        for key, t in self._init_state(p.detach().to(torch.float32, memory_format=torch.contiguous_format),
                                       group).items():
            state[key] = t if self.fp32_optimizer_states else t.to(p.dtype)
        return state

    def _step_converted(self, group: dict, entries: List[Tuple[torch.Tensor, Hashable]]) -> None:
        """Step each (parameter, state key) pair with the op, one call per parameter dtype:
        a bf16/fp16 (or non-contiguous) parameter and low-precision moments are widened to
        fp32 copies for the step and rounded back after it. `self.state[key]` is the state
        (the parameter itself for step(); a sub-group id for DeepSpeed's step_subgroup)."""
        by_dtype: Dict[torch.dtype, list] = {}
        for i, (p, key) in enumerate(entries):
            if p.device.type != "cpu" or p.dtype not in (torch.float32, *LOW_PRECISION):
                raise TypeError(f"{type(self).__name__}: parameter {i} is {p.dtype} on {p.device}; it steps "
                                "fp32, bf16 or fp16 CPU parameters")
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if not self.state[key]:
                self.state[key].update(self._new_state(p, group))
            by_dtype.setdefault(p.dtype, []).append((p, self.state[key]))
        keys = self._state_keys(group)
        for items in by_dtype.values():
            steps = [st["step"] for _, st in items]
            torch._foreach_add_(steps, 1.0)
            work = [p if p.dtype == torch.float32 and p.is_contiguous()
                    else p.detach().to(torch.float32, memory_format=torch.contiguous_format) for p, _ in items]
            grads = [p.grad.contiguous() for p, _ in items]
            states = {k: [st[k].to(torch.float32, memory_format=torch.contiguous_format) for _, st in items]
                      for k in keys}
            self._update(work, grads, states, steps, group)
            for (p, st), w, *s32 in zip(items, work, *(states[k] for k in keys)):
                if w is not p:
                    p.detach().copy_(w)
                for k, t in zip(keys, s32):
                    if t is st[k]:
                        continue
                    if self.fp32_optimizer_states:
                        # torch's load_state_dict casts moments to the parameter's dtype: keep them fp32
                        st[k] = t
                    else:
                        st[k].copy_(t)

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
