"""CPU Lion: the compiled torch op (cpu_lion.cpp + cpu_lion_op.cpp, `lion_step`) behind a
checked Python API.

* `cpu_lion_step(params, grads, exp_avgs, *, lr, betas, weight_decay, copy_out)` steps flat
  contiguous fp32 tensors in place (grads fp32/bf16/fp16, optional bf16/fp16 copy-out), as
  cpu_adam_step does for Adam.
* `CPULion`, a torch.optim.Optimizer with DeepSpeed's DeepSpeedCPULion hyperparameters and
  state (`exp_avg`, plus a float32 `step` like torch's optimizers keep).

The maths is the paper's (and lion.Lion's, the torch implementation used off the CPU):
  c = beta1*m + (1-beta1)*g;  p = p*(1 - lr*wd) - lr*sign(c);  m = beta2*m + (1-beta2)*g
Without the op, both fall back to lion.Lion's torch maths with one warning.
"""
from __future__ import annotations

import ctypes
from typing import Dict, Optional, Tuple

import torch

from . import builder, torch_ops
from .cpu_optimizer import CPUOptimizer
from .loader import LazyOp
from .tensor_args import (TensorOrList, as_list, check_flat_args, copy_out_after_fallback, default_threads, fp32_views,
                          run_checked)


def _fake(params, grads, exp_avgs, copy_out, lr, beta1, beta2, weight_decay, num_threads) -> None:
    """lion_step on fake tensors (torch.compile): the op's checks, no computation."""
    check_flat_args("lion_step", params, grads, {"exp_avgs": exp_avgs}, copy_out or None)


def _bind(lib: ctypes.CDLL):
    lib.ds_cpu_lion_isa.restype = ctypes.c_char_p
    return torch_ops.register(lib, "ds_cpu_lion", "lion_step", _fake)


class CpuLionOp(LazyOp):
    def __init__(self, isa: Optional[str] = None):
        super().__init__("CPU Lion", lambda: builder.cpu_lion_spec(isa), _bind)


_OP = CpuLionOp()


def cpu_lion_available() -> bool:
    return _OP.load()


def cpu_lion_step(params: TensorOrList, grads: TensorOrList, exp_avgs: TensorOrList, *, lr: float,
                  betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                  copy_out: Optional[TensorOrList] = None, num_threads: Optional[int] = None,
                  op: Optional[CpuLionOp] = None) -> None:
    """One Lion step, in place, over one tensor or a list (see cpu_adam_step for the layout
    rules; Lion keeps one state, exp_avg)."""
    beta1, beta2 = betas
    op = op or _OP
    ps = as_list(params)
    if ps and op.load():
        run_checked(lambda: op.torch_op(ps, as_list(grads), as_list(exp_avgs), as_list(copy_out) or [], float(lr),
                                        float(beta1), float(beta2), float(weight_decay),
                                        num_threads or default_threads()),
                    lambda: check_flat_args("cpu_lion_step", ps, grads, {"exp_avgs": exp_avgs}, copy_out))
        return
    args = check_flat_args("cpu_lion_step", ps, grads, {"exp_avgs": exp_avgs}, copy_out)
    if args.n == 0:
        return
    op.warn_fallback("torch's Lion maths (slower)")
    from .lion import lion_update

    grads32, st = fp32_views(args)
    lion_update(args.params, grads32, st["exp_avgs"], lr, beta1, beta2, weight_decay)
    copy_out_after_fallback(args)


def _init_state(p: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
    return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}


class CPULion(CPUOptimizer):
    """Lion on CPU tensors through the compiled SIMD op (DeepSpeed's DeepSpeedCPULion)."""

    label = "CPU Lion"

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, num_threads: Optional[int] = None):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"{type(self).__name__}: lr and weight_decay must be >= 0 (got {lr}, {weight_decay})")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"{type(self).__name__}: betas must lie in [0, 1], got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.num_threads = num_threads
        self.op = _OP

    def _init_state(self, p, group):
        return _init_state(p, group)

    def _state_keys(self, group):
        return ("exp_avg",)

    def _update(self, params, grads, states, step, group):
        cpu_lion_step(params, grads, states["exp_avg"], lr=float(group["lr"]),
                      betas=tuple(group["betas"]), weight_decay=group["weight_decay"], num_threads=self.num_threads,
                      op=self.op)
