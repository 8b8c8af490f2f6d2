"""DeepSpeed's tensor-fragment API: whole (or, at stage 3, this rank's) fp32 masters,
optimizer state and gradients of one model parameter, whatever holds their pieces.

Libraries built on DeepSpeed (PEFT, TRL, users' scripts) read and write a parameter's
fp32 master, its Adam moments and its gradient with these calls, under any ZeRO stage.
What a parameter's pieces are, and where they live, is the business of the strategy that
owns it (runtime/core/strategy.py: `full_hp`, `set_full_hp`, `full_grad`, ...); every strategy
links the module's parameters to itself when it is built, so this module asks the
parameter and never the engine or the topology.

Semantics (DeepSpeed 0.19.8's signatures; see docs/zero.md "Reading and writing one
parameter"):
- `safe_get_full_fp32_param(p)`: the fp32 master, not the low-precision module weight.
- `safe_get_full_optimizer_state(p, key)`: e.g. "exp_avg", "exp_avg_sq", in fp32.
- `safe_get_full_grad(p)`: the gradient the optimizer will step with, in fp32: averaged
  over the data-parallel ranks, divided by the accumulation steps, still multiplied by the
  fp16 loss scale and not clipped. Available from engine.backward() on the
  gradient-accumulation boundary until engine.step(); outside that window a FragmentError
  (a ValueError, as DeepSpeed raises). The first access in the window reduces the
  gradients (collectively) and step() does not reduce them again.
- `safe_set_*` take the whole value on every rank; each rank keeps its pieces. A new fp32
  master reaches the module's low-precision copy at once (DeepSpeed writes only the
  master and refreshes the copy at the next step); a new gradient or state is what the
  next step uses.
- The `safe_*_local_*` calls read and write this rank's padded chunk of a ZeRO-3
  parameter; below stage 3 they refuse, as DeepSpeed does.
- Every call is collective over the parameter's data-parallel group when the value is
  spread over it: call it on every rank, for the same parameters in the same order.
- A parameter the optimizer does not step (frozen) gives None; so does one no engine
  owns, except that `safe_get_full_grad` then returns its `.grad` (as DeepSpeed).
  Unlike DeepSpeed, stage 0 answers too (its master is the fp32 parameter itself, or the
  fp32 copy under bf16/fp16), where DeepSpeed returns None without bf16.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..core.strategy import FragmentError, owner_of

__all__ = ["FragmentError", "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_get_local_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized"]


def _owner(param):
    return owner_of(param)


def _key(optim_state_key) -> str:
    if not isinstance(optim_state_key, str):
        raise FragmentError(f"optim_state_key: expected a state name such as 'exp_avg', got {optim_state_key!r}")
    return optim_state_key


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole fp32 master of `param` (collective)."""
    s = _owner(param)
    return None if s is None else s.full_hp(param)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the fp32 master of `param` (and the module's copy) with the whole `value`."""
    s = _owner(param)
    if s is not None:
        s.set_full_hp(param, value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    """The whole fp32 optimizer state `optim_state_key` of `param` (collective)."""
    s = _owner(param)
    return None if s is None else s.full_hp(param, _key(optim_state_key))


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    s = _owner(param)
    if s is not None:
        s.set_full_hp(param, value, _key(optim_state_key))


def safe_get_full_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The whole averaged fp32 gradient of `param` (collective; between backward and step)."""
    s = _owner(param)
    if s is None:
        return param.grad
    return s.full_grad(param)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace the gradient the next step uses for `param` (between backward and step)."""
    s = _owner(param)
    if s is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    s.set_full_grad(param, value)


def _local_owner(param, what: str):
    s = _owner(param)
    if s is None:
        raise FragmentError(f"{what}: the parameter is not owned by a ZeRO stage 3 engine")
    return s


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """This rank's padded chunk of the fp32 master of a ZeRO-3 parameter."""
    return _local_owner(param, "safe_get_local_fp32_param").local_hp(param)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _local_owner(param, "safe_set_local_fp32_param").set_local_hp(param, value)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> Optional[torch.Tensor]:
    return _local_owner(param, "safe_get_local_optimizer_state").local_hp(param, _key(optim_state_key))


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    _local_owner(param, "safe_set_local_optimizer_state").set_local_hp(param, value, _key(optim_state_key))


def safe_get_local_grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    return _local_owner(param, "safe_get_local_grad").local_grad(param)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    _local_owner(param, "safe_set_local_grad").set_local_grad(param, value)


def safe_update_full_grad_vectorized(param_list: List[torch.nn.Parameter], update_func: Callable) -> None:
    """`update_func(grad, param)` -> new gradient, for each trainable parameter in turn."""
    for p in param_list:
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))
