"""CPU Adam/AdamW: the compiled torch op (cpu_adam.cpp + cpu_adam_op.cpp, `adam_step`)
behind a checked Python API.

Two ways in:

* `cpu_adam_step(...)` steps flat, contiguous fp32 master tensors in place. This is the
  entry point for optimizer offload: gradients may be fp32, bf16 or fp16, and the new
  parameters can be written into a bf16/fp16 copy in the same pass.
* `CPUAdam`, a torch.optim.Optimizer whose state_dict() matches torch.optim.AdamW's
  (same group keys, same per-parameter `step`/`exp_avg`/`exp_avg_sq`), so checkpoints
  move between the two in both directions. Its step() passes the state's step tensors to
  the op (which groups parameters by count itself), so `torch.compile` traces it whole.

`cpu_adam_available()` answers whether the op can be used, building it on first call.
If it cannot be built, both entry points fall back to torch's fused AdamW kernel and
warn once with the compiler's error: a missing compiler costs speed, not the job.
"""
from __future__ import annotations

import ctypes
from typing import Dict, List, Optional, Tuple

import torch

from . import builder, torch_ops
from .cpu_optimizer import CPUOptimizer
from .fused_step import FusedCPUStep, KernelUnavailable
from .loader import LazyOp
from .tensor_args import (StepCount, TensorOrList, as_list, check_flat_args, check_steps, copy_out_after_fallback,
                          default_threads, fp32_views, run_checked, step_args)


def _fake(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, copy_out, steps, step, lr, beta1, beta2, eps,
          weight_decay, decoupled, amsgrad, maximize, bias_correction, num_threads) -> None:
    """adam_step on fake tensors (torch.compile): the op's checks, no computation."""
    if amsgrad and params and not max_exp_avg_sqs:
        raise ValueError("adam_step: amsgrad=True needs max_exp_avg_sqs")
    check_flat_args("adam_step", params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
                                                 "max_exp_avg_sqs": max_exp_avg_sqs or None}, copy_out or None)
    if steps:
        check_steps("adam_step", steps, len(params))


def _bind(lib: ctypes.CDLL):
    lib.ds_cpu_adam_isa.restype = ctypes.c_char_p
    return torch_ops.register(lib, "ds_cpu_adam", "adam_step", _fake)


class CpuAdamOp(LazyOp):
    """One build of the op (one instruction set), loaded on first use.

    The process-wide default, for this CPU's best instruction set, is behind
    cpu_adam_step/CPUAdam; tests and the benchmark make others to compare levels.
    """

    def __init__(self, isa: Optional[str] = None):
        super().__init__("CPU Adam", lambda: builder.cpu_adam_spec(isa), _bind)
        self.isa = isa


_OP = CpuAdamOp()


def cpu_adam_available() -> bool:
    """True when the compiled op is loaded; builds it (or loads the cached build) on first call."""
    return _OP.load()


def cpu_adam_info() -> Dict[str, object]:
    """What was loaded: instruction set, library path, build time; or the build error."""
    if not _OP.load():
        return {"available": False, "error": _OP.error}
    built = _OP.built
    return {
        "available": True,
        "isa": _OP.lib.ds_cpu_adam_isa().decode(),
        "path": str(built.path),
        "cached": built.cached,
        "seconds": built.seconds,
        "build_seconds": built.extra.get("build_seconds"),
    }


def cpu_adam_step(
    params: TensorOrList,
    grads: TensorOrList,
    exp_avgs: TensorOrList,
    exp_avg_sqs: TensorOrList,
    *,
    step: StepCount,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    amsgrad: bool = False,
    max_exp_avg_sqs: Optional[TensorOrList] = None,
    maximize: bool = False,
    bias_correction: bool = True,
    copy_out: Optional[TensorOrList] = None,
    num_threads: Optional[int] = None,
    op: Optional[CpuAdamOp] = None,
) -> None:
    """One Adam(W) step, in place, over one tensor or a list of tensors.

    params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs with amsgrad): contiguous fp32 CPU
    tensors. grads: contiguous CPU tensors of fp32, bf16 or fp16 (one dtype per call),
    each with its parameter's element count; shapes may differ (flat buffers are fine).
    step: the step count *including* this update (1 on the first call), as torch counts;
    or one float32 step tensor per parameter (an optimizer's state, already incremented).
    decoupled_weight_decay: True is AdamW (p *= 1 - lr*wd), False is Adam's L2 term.
    bias_correction: False drops Adam's 1 - beta^step corrections (DeepSpeed's option).
    copy_out: optional bf16/fp16 tensors that receive the updated parameters in the same
    pass (what offload sends back to the device). num_threads: default torch's.
    op: a specific build (CpuAdamOp(isa)); default this CPU's best.

    Matches torch.optim.AdamW/Adam elementwise to fp32 rounding. Mismatched, non-contiguous
    or non-CPU tensors raise ValueError/TypeError naming the argument and index.
    """
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError("cpu_adam_step: amsgrad=True needs max_exp_avg_sqs")
    beta1, beta2 = betas
    op = op or _OP
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "max_exp_avg_sqs": max_exp_avg_sqs if amsgrad else None}
    ps = as_list(params)
    if ps and op.load():
        count, steps = (step, []) if isinstance(step, int) else (0, list(step))
        run_checked(lambda: op.torch_op(ps, as_list(grads), as_list(exp_avgs), as_list(exp_avg_sqs),
                                        as_list(states["max_exp_avg_sqs"]) or [], as_list(copy_out) or [], steps,
                                        count, float(lr), float(beta1), float(beta2), float(eps),
                                        float(weight_decay), bool(decoupled_weight_decay), bool(amsgrad),
                                        bool(maximize), bool(bias_correction), num_threads or default_threads()),
                    lambda: step_args("cpu_adam_step", step,
                                      check_flat_args("cpu_adam_step", ps, grads, states, copy_out).n))
        return
    args = check_flat_args("cpu_adam_step", ps, grads, states, copy_out)
    count, steps = step_args("cpu_adam_step", step, args.n)
    if args.n == 0:
        return
    op.warn_fallback("torch.optim.AdamW(fused=True) (slower)")
    _torch_step(args, count, steps, lr, betas, eps, weight_decay, decoupled_weight_decay, amsgrad, maximize,
                bias_correction)


def _torch_step(args, step, step_tensors, lr, betas, eps, weight_decay, decoupled, amsgrad, maximize,
                bias_correction) -> None:
    """The fallback: torch's fused CPU Adam on the same state, then the copy-out."""
    from torch.optim.adam import adam

    if not bias_correction:
        raise RuntimeError("cpu_adam_step: bias_correction=False needs the dslaunch CPU Adam op, which is "
                           f"unavailable: {_OP.error}")
    grads, st = fp32_views(args)
    # the fused kernel adds the 1 itself (to copies: the caller's step tensors stay as they are)
    steps = [s - 1 for s in step_tensors] if step_tensors else [torch.tensor(float(step - 1)) for _ in args.params]
    adam(args.params, grads, st["exp_avgs"], st["exp_avg_sqs"], st.get("max_exp_avg_sqs", []), steps, fused=True,
         decoupled_weight_decay=decoupled, amsgrad=amsgrad, beta1=betas[0], beta2=betas[1], lr=lr,
         weight_decay=weight_decay, eps=eps, maximize=maximize)
    copy_out_after_fallback(args)


def _init_state(p: torch.Tensor, group: dict) -> Dict[str, torch.Tensor]:
    state = {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _state_keys(group: dict) -> Tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")


def _update(ps, grads, states: Dict[str, List[torch.Tensor]], step: StepCount, group: dict, decoupled_default: bool,
            op: Optional[CpuAdamOp] = None, num_threads: Optional[int] = None) -> None:
    """One op call; `states` maps each state key to one tensor per parameter; `group` holds
    torch.optim.Adam's keys (lr, betas, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay)."""
    amsgrad = bool(group.get("amsgrad", False))
    cpu_adam_step(ps, grads, states["exp_avg"], states["exp_avg_sq"], step=step,
                  lr=float(group["lr"]), betas=tuple(group["betas"]), eps=group["eps"],
                  weight_decay=group["weight_decay"],
                  decoupled_weight_decay=group.get("decoupled_weight_decay", decoupled_default),
                  amsgrad=amsgrad, max_exp_avg_sqs=states["max_exp_avg_sq"] if amsgrad else None,
                  maximize=group.get("maximize", False), bias_correction=group.get("bias_correction", True),
                  num_threads=num_threads, op=op)


def torch_adam_step(optimizer: torch.optim.Optimizer) -> FusedCPUStep:
    """torch.optim.Adam / AdamW (exactly those classes) stepped by the kernel in offload."""
    if not _OP.load():
        raise KernelUnavailable(f"the dslaunch CPU Adam op is unavailable: {_OP.error}")
    decoupled = isinstance(optimizer, torch.optim.AdamW)

    def step(p, g, state, count, group):
        _update([p], [g], {k: [state[k]] for k in _state_keys(group)}, count, group, decoupled)

    return FusedCPUStep(f"dslaunch CPU Adam ({_OP.built.isa})", _init_state, step)


class CPUAdam(CPUOptimizer):
    """Adam/AdamW on CPU tensors through the compiled SIMD op; a drop-in for torch.optim.AdamW.

    Defaults follow AdamW (weight_decay=0.01, decoupled). `decoupled_weight_decay=False`
    gives torch.optim.Adam's L2 form; `bias_correction=False` drops the 1 - beta^step
    terms (DeepSpeed's option). Parameters must be fp32 CPU tensors (the master copy) when
    stepped. All parameters of a group that share a step count go to the op in one call.
    """

    label = "CPU Adam"

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = True, bias_correction: bool = True,
                 num_threads: Optional[int] = None):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"{type(self).__name__}: lr, eps and weight_decay must be >= 0 "
                             f"(got {lr}, {eps}, {weight_decay})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"{type(self).__name__}: betas must lie in [0, 1), got {betas}")
        # The keys torch.optim.AdamW writes into every group, so torch can load our state_dict.
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=decoupled_weight_decay)
        if not bias_correction:
            defaults["bias_correction"] = False
        super().__init__(params, defaults)
        self.num_threads = num_threads
        self.op = _OP

    def _init_state(self, p, group):
        return _init_state(p, group)

    def _state_keys(self, group):
        return _state_keys(group)

    def _update(self, params, grads, states, step, group):
        _update(params, grads, states, step, group, True, self.op, self.num_threads)


def adam_undo_step(params: List[torch.Tensor], grads: List[torch.Tensor], states: Dict[str, List[torch.Tensor]],
                   step: int, group: dict, decoupled_default: bool = True) -> None:
    """Undo the Adam(W) step numbered `step` (the count that step produced), in place on fp32
    tensors: given the parameters, moments and the gradient after that step, recover them as
    they were before it (to fp32 rounding). DeepSpeed's ZeRO-3 offload rolls a sub-group back
    with this when a step must not have happened (DeepSpeedCPUAdam.rollback_subgroup).

    The inverse of the kernel's update, term by term, with the group's own hyperparameters:
      p_prev = (p + lr * m_hat / (sqrt(v_hat) + eps)) / (1 - lr*wd)   (AdamW; Adam: no divide)
      m_prev = (m - (1-beta1) g') / beta1,  v_prev = (v - (1-beta2) g'^2) / beta2
    with g' the gradient the step used (negated for maximize; plus wd * p_prev in Adam's L2
    form). A moment's rounding may leave v_prev a hair below zero: it is clamped at zero.
    Undoing several steps compounds rounding where a gradient was far smaller than a later
    one (its square is lost in the later one's rounding of v), as it does in DeepSpeed's op.
    AMSGrad's running maximum cannot be undone, and beta = 0 leaves nothing to divide by:
    both are refused with ValueError."""
    beta1, beta2 = group["betas"]
    if group.get("amsgrad", False):
        raise ValueError("adam_undo_step: amsgrad=True cannot be undone (the running maximum of exp_avg_sq "
                         "forgets what it replaced)")
    if beta1 == 0.0 or beta2 == 0.0:
        raise ValueError(f"adam_undo_step: betas {tuple(group['betas'])}: a step with beta 0 forgets the moments "
                         "and cannot be undone")
    if step < 1:
        raise ValueError(f"adam_undo_step: step must be >= 1 (the count the undone step produced), got {step}")
    lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
    decoupled = group.get("decoupled_weight_decay", decoupled_default)
    if group.get("bias_correction", True):
        bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    else:
        bc1 = bc2 = 1.0
    for p, g, m, v in zip(params, grads, states["exp_avg"], states["exp_avg_sq"]):
        g = g.to(torch.float32).view_as(p)
        if group.get("maximize", False):
            g = -g
        m, v = m.view_as(p), v.view_as(p)
        update = (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
        p.add_(update)
        if decoupled:
            p.div_(1.0 - lr * wd)
        else:
            g = g + wd * p
        m.sub_((1.0 - beta1) * g).div_(beta1)
        v.sub_((1.0 - beta2) * g * g).div_(beta2).clamp_(min=0.0)
