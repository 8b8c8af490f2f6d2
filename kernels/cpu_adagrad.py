"""CPU Adagrad: the compiled torch op (cpu_adagrad.cpp + cpu_adagrad_op.cpp, `adagrad_step`)
behind a checked Python API.

* `cpu_adagrad_step(params, grads, sums, *, step, lr, lr_decay, eps, weight_decay,
  maximize, copy_out)` steps flat contiguous fp32 tensors in place, as cpu_adam_step does.
* `CPUAdagrad`, a torch.optim.Optimizer whose groups and state (`sum`, `step`) are
  torch.optim.Adagrad's, so state_dicts move between the two.

The update is torch.optim.Adagrad's: g += wd*p (L2); sum += g*g;
p -= lr / (1 + (step-1)*lr_decay) * g / (sqrt(sum) + eps). Without the op, both fall back to
torch's Adagrad kernel with one warning.
"""
from __future__ import annotations

import ctypes
from typing import Dict, Optional

import torch

from . import builder, torch_ops
from .cpu_optimizer import CPUOptimizer
from .fused_step import FusedCPUStep, KernelUnavailable
from .loader import LazyOp
from .tensor_args import (StepCount, TensorOrList, as_list, check_flat_args, check_steps, copy_out_after_fallback,
                          default_threads, fp32_views, run_checked, step_args)


def _fake(params, grads, sums, copy_out, steps, step, lr, lr_decay, eps, weight_decay, maximize,
          num_threads) -> None:
    """adagrad_step on fake tensors (torch.compile): the op's checks, no computation."""
    check_flat_args("adagrad_step", params, grads, {"sums": sums}, copy_out or None)
    if steps:
        check_steps("adagrad_step", steps, len(params))


def _bind(lib: ctypes.CDLL):
    lib.ds_cpu_adagrad_isa.restype = ctypes.c_char_p
    return torch_ops.register(lib, "ds_cpu_adagrad", "adagrad_step", _fake)


class CpuAdagradOp(LazyOp):
    def __init__(self, isa: Optional[str] = None):
        super().__init__("CPU Adagrad", lambda: builder.cpu_adagrad_spec(isa), _bind)


_OP = CpuAdagradOp()


def cpu_adagrad_available() -> bool:
    return _OP.load()


def cpu_adagrad_step(params: TensorOrList, grads: TensorOrList, sums: TensorOrList, *, step: StepCount, lr: float,
                     lr_decay: float = 0.0, eps: float = 1e-10, weight_decay: float = 0.0, maximize: bool = False,
                     copy_out: Optional[TensorOrList] = None, num_threads: Optional[int] = None,
                     op: Optional[CpuAdagradOp] = None) -> None:
    """One Adagrad step, in place (see cpu_adam_step for the layout rules). step: the count
    including this update (1 on the first call), or one float32 step tensor per parameter."""
    op = op or _OP
    ps = as_list(params)
    if ps and op.load():
        count, steps = (step, []) if isinstance(step, int) else (0, list(step))
        run_checked(lambda: op.torch_op(ps, as_list(grads), as_list(sums), as_list(copy_out) or [], steps, count,
                                        float(lr), float(lr_decay), float(eps), float(weight_decay), bool(maximize),
                                        num_threads or default_threads()),
                    lambda: step_args("cpu_adagrad_step", step,
                                      check_flat_args("cpu_adagrad_step", ps, grads, {"sums": sums}, copy_out).n))
        return
    args = check_flat_args("cpu_adagrad_step", ps, grads, {"sums": sums}, copy_out)
    count, step_tensors = step_args("cpu_adagrad_step", step, args.n)
    if args.n == 0:
        return
    op.warn_fallback("torch.optim.Adagrad's kernel (slower)")
    from torch.optim.adagrad import adagrad

    grads32, st = fp32_views(args)
    # torch's single-tensor Adagrad adds the 1 (to copies: the caller's step tensors stay as they are)
    steps = ([s - 1 for s in step_tensors] if step_tensors
             else [torch.tensor(float(count - 1)) for _ in args.params])
    adagrad(args.params, grads32, st["sums"], steps, foreach=False, lr=lr, weight_decay=weight_decay,
            lr_decay=lr_decay, eps=eps, maximize=maximize)
    copy_out_after_fallback(args)


def _init_state(p: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
    return {"sum": torch.full_like(p, float(group.get("initial_accumulator_value", 0.0)),
                                   memory_format=torch.preserve_format)}


def _update(ps, grads, states, step: StepCount, group: dict, op=None, num_threads=None) -> None:
    """`states["sum"]`: one tensor per parameter; `group` holds torch.optim.Adagrad's keys
    (lr, lr_decay, eps, weight_decay, maximize)."""
    cpu_adagrad_step(ps, grads, states["sum"], step=step, lr=float(group["lr"]),
                     lr_decay=group.get("lr_decay", 0.0), eps=group["eps"], weight_decay=group["weight_decay"],
                     maximize=group.get("maximize", False), num_threads=num_threads, op=op)


def torch_adagrad_step(optimizer: torch.optim.Optimizer) -> FusedCPUStep:
    """torch.optim.Adagrad (exactly that class) stepped by the kernel in offload."""
    if not _OP.load():
        raise KernelUnavailable(f"the dslaunch CPU Adagrad op is unavailable: {_OP.error}")

    def step(p, g, state, count, group):
        _update([p], [g], {"sum": [state["sum"]]}, count, group)

    return FusedCPUStep(f"dslaunch CPU Adagrad ({_OP.built.isa})", _init_state, step)


class CPUAdagrad(CPUOptimizer):
    """torch.optim.Adagrad's update on CPU tensors through the compiled SIMD op."""

    label = "CPU Adagrad"

    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, *, maximize: bool = False,
                 num_threads: Optional[int] = None):
        if lr < 0 or lr_decay < 0 or weight_decay < 0 or eps < 0 or initial_accumulator_value < 0:
            raise ValueError(f"{type(self).__name__}: lr, lr_decay, weight_decay, eps and "
                             "initial_accumulator_value must be >= 0")
        # torch.optim.Adagrad's group keys, so torch can load our state_dict and we theirs.
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=None, maximize=maximize,
                        differentiable=False, fused=None)
        super().__init__(params, defaults)
        self.num_threads = num_threads
        self.op = _OP

    def _init_state(self, p, group):
        return _init_state(p, group)

    def _state_keys(self, group):
        return ("sum",)

    def _update(self, params, grads, states, step, group):
        _update(params, grads, states, step, group, self.op, self.num_threads)
