"""The fused CPU step protocol: how ZeRO offload asks an optimizer to update its host
partitions with a compiled kernel instead of calling optimizer.step().

An optimizer that can do this provides `fused_cpu_step() -> FusedCPUStep` (CPUAdam,
CPULion and CPUAdagrad do); it raises FusedStepUnavailable with a one-line reason when
it cannot (KernelUnavailable when its op failed to build or load). torch's own Adam, AdamW
and Adagrad cannot carry a method of ours, so `fused_cpu_step(optimizer)` maps those exact
classes (never subclasses: a subclass may change the maths) to the kernel that computes
the same update. Everything else is stepped by the optimizer itself.

The host owns the step counter (state["step"]); the FusedCPUStep owns the per-element
state: `init_state(param, group)` makes it for a flat fp32 tensor (or a slice of one, for
NVMe sub-groups) and `step(param, grad, state, step, group)` updates all of it in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch


class FusedStepUnavailable(Exception):
    """Why an optimizer's update cannot run as a fused CPU kernel (one line)."""


class KernelUnavailable(FusedStepUnavailable):
    """The optimizer has a fused step, but its op could not be built or loaded on this
    machine: the step falls back to torch (slower), the job goes on."""


@dataclass(frozen=True)
class FusedCPUStep:
    kernel: str  # what runs the update, for the start-up line: "dslaunch CPU Adam (avx512)"
    init_state: Callable[[torch.Tensor, dict], Dict[str, torch.Tensor]]
    step: Callable[[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor], int, dict], None]


def fused_cpu_step(optimizer: torch.optim.Optimizer) -> FusedCPUStep:
    """The optimizer's fused CPU step; raises FusedStepUnavailable naming why there is none."""
    if getattr(optimizer, "torch_step_requested", False):  # the config's torch_adam: true
        raise FusedStepUnavailable("torch_adam: true asks for torch's own step")
    provider = getattr(optimizer, "fused_cpu_step", None)
    if callable(provider):
        return provider()
    adapter = _torch_equivalents().get(type(optimizer))
    if adapter is not None:
        return adapter(optimizer)
    raise FusedStepUnavailable(f"{type(optimizer).__name__} provides no fused CPU step")


def describe(optimizer: torch.optim.Optimizer) -> str:
    """What steps this optimizer on the CPU: "CPUAdam via dslaunch CPU Adam (avx512)", or
    "SGD via torch (<reason there is no fused step>)"."""
    name = type(optimizer).__name__
    try:
        return f"{name} via {fused_cpu_step(optimizer).kernel}"
    except FusedStepUnavailable as e:
        return f"{name} via torch ({e})"


def _torch_equivalents() -> Dict[type, Callable[[torch.optim.Optimizer], FusedCPUStep]]:
    from .cpu_adagrad import torch_adagrad_step
    from .cpu_adam import torch_adam_step

    return {torch.optim.Adam: torch_adam_step, torch.optim.AdamW: torch_adam_step,
            torch.optim.Adagrad: torch_adagrad_step}
