"""CPU Adam/AdamW: the compiled op (cpu_adam.cpp) behind a checked Python API.

Two ways in:

* `cpu_adam_step(...)` steps flat, contiguous fp32 master tensors in place. This is the
  entry point for optimizer offload: gradients may be fp32, bf16 or fp16, and the new
  parameters can be written into a bf16/fp16 copy in the same pass.
* `CPUAdam`, a torch.optim.Optimizer whose state_dict() matches torch.optim.AdamW's
  (same group keys, same per-parameter `step`/`exp_avg`/`exp_avg_sq`), so checkpoints
  move between the two in both directions.

`cpu_adam_available()` answers whether the op can be used, building it on first call.
If it cannot be built, both entry points fall back to torch's fused AdamW kernel and
warn once with the compiler's error: a missing compiler costs speed, not the job.
"""
from __future__ import annotations

import ctypes
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import builder
from .loader import LazyOp

_GRAD_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_CODES = {None: -1, torch.bfloat16: 1, torch.float16: 2}

TensorOrList = Union[torch.Tensor, Sequence[torch.Tensor]]


class AdamHyper(ctypes.Structure):
    """Mirrors `struct AdamHyper` in cpu_adam.cpp, field for field."""

    _fields_ = [
        ("beta1_complement", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("beta2_complement", ctypes.c_float),
        ("eps_scaled", ctypes.c_float),
        ("step_scaled", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("decay_factor", ctypes.c_float),
        ("decoupled", ctypes.c_int32),
        ("amsgrad", ctypes.c_int32),
        ("maximize", ctypes.c_int32),
    ]


def _bind(lib: ctypes.CDLL) -> None:
    lib.ds_cpu_adam_isa.restype = ctypes.c_char_p
    lib.ds_cpu_adam_step.restype = ctypes.c_int
    lib.ds_cpu_adam_step.argtypes = [
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(AdamHyper), ctypes.c_int32,
    ]


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


def _as_list(x: Optional[TensorOrList]) -> Optional[List[torch.Tensor]]:
    if x is None:
        return None
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check(name: str, ts: List[torch.Tensor], numels: List[int], dtypes) -> None:
    """One fast pass over a list; the slow path only runs to word the error."""
    for i, t in enumerate(ts):
        if t.dtype in dtypes and t.is_cpu and t.numel() == numels[i] and t.is_contiguous():
            continue
        if not t.is_cpu:
            raise ValueError(f"cpu_adam_step: {name}[{i}] is on {t.device}; the CPU op needs CPU tensors")
        if t.dtype not in dtypes:
            allowed = ", ".join(_name(d) for d in dtypes)
            raise TypeError(f"cpu_adam_step: {name}[{i}] has dtype {_name(t.dtype)}; expected {allowed}")
        if t.numel() != numels[i]:
            raise ValueError(f"cpu_adam_step: {name}[{i}] has {t.numel()} elements, the parameter has {numels[i]}")
        # A silent .contiguous() copy would receive the update and be thrown away.
        raise ValueError(f"cpu_adam_step: {name}[{i}] is not contiguous; the update would be lost in a copy")


def _hyper(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           decoupled: bool, amsgrad: bool, maximize: bool) -> AdamHyper:
    if step < 1:
        raise ValueError(f"cpu_adam_step: step must be >= 1 (the count after this update), got {step}")
    bc1 = 1.0 - beta1 ** step
    bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
    return AdamHyper(
        beta1_complement=1.0 - beta1,
        beta2=beta2,
        beta2_complement=1.0 - beta2,
        eps_scaled=eps * bc2_sqrt,
        step_scaled=lr / bc1 * bc2_sqrt,
        weight_decay=0.0 if decoupled else weight_decay,
        decay_factor=1.0 - lr * weight_decay if decoupled else 1.0,
        decoupled=int(decoupled),
        amsgrad=int(amsgrad),
        maximize=int(maximize),
    )


def _ptrs(ts: Optional[List[torch.Tensor]]):
    if ts is None:
        return None
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def cpu_adam_step(
    params: TensorOrList,
    grads: TensorOrList,
    exp_avgs: TensorOrList,
    exp_avg_sqs: TensorOrList,
    *,
    step: int,
    lr: float,
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = True,
    amsgrad: bool = False,
    max_exp_avg_sqs: Optional[TensorOrList] = None,
    maximize: bool = False,
    copy_out: Optional[TensorOrList] = None,
    num_threads: Optional[int] = None,
    op: Optional[CpuAdamOp] = None,
) -> None:
    """One Adam(W) step, in place, over one tensor or a list of tensors.

    params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs with amsgrad): contiguous fp32 CPU
    tensors. grads: contiguous CPU tensors of fp32, bf16 or fp16 (one dtype per call),
    each with its parameter's element count; shapes may differ (flat buffers are fine).
    step: the step count *including* this update (1 on the first call), as torch counts.
    decoupled_weight_decay: True is AdamW (p *= 1 - lr*wd), False is Adam's L2 term.
    copy_out: optional bf16/fp16 tensors that receive the updated parameters in the same
    pass (what offload sends back to the device). num_threads: default torch's.
    op: a specific build (CpuAdamOp(isa)); default this CPU's best.

    Matches torch.optim.AdamW/Adam elementwise to fp32 rounding. Mismatched, non-contiguous
    or non-CPU tensors raise ValueError/TypeError naming the argument and index.
    """
    ps, gs, ms, vs = _as_list(params), _as_list(grads), _as_list(exp_avgs), _as_list(exp_avg_sqs)
    maxs, outs = _as_list(max_exp_avg_sqs), _as_list(copy_out)
    n = len(ps)
    for name, lst in (("grads", gs), ("exp_avgs", ms), ("exp_avg_sqs", vs), ("max_exp_avg_sqs", maxs), ("copy_out", outs)):
        if lst is not None and len(lst) != n:
            raise ValueError(f"cpu_adam_step: {n} params but {len(lst)} {name}")
    if amsgrad and maxs is None:
        raise ValueError("cpu_adam_step: amsgrad=True needs max_exp_avg_sqs")
    beta1, beta2 = betas
    hyper = _hyper(step, lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, amsgrad, maximize)
    grad_dtype = gs[0].dtype if n else torch.float32
    out_dtype = outs[0].dtype if outs else None
    if grad_dtype not in _GRAD_CODES:
        raise TypeError(f"cpu_adam_step: grads[0] has dtype {_name(grad_dtype)}; expected float32, bfloat16 or float16")
    if outs and out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"cpu_adam_step: copy_out[0] has dtype {_name(out_dtype)}; expected bfloat16 or float16")
    numels = [p.numel() for p in ps]
    _check("params", ps, numels, (torch.float32,))
    _check("grads", gs, numels, (grad_dtype,))
    _check("exp_avgs", ms, numels, (torch.float32,))
    _check("exp_avg_sqs", vs, numels, (torch.float32,))
    if amsgrad:
        _check("max_exp_avg_sqs", maxs, numels, (torch.float32,))
    if outs:
        _check("copy_out", outs, numels, (out_dtype,))
    if n == 0:
        return
    op = op or _OP
    if not op.load():
        op.warn_fallback("torch.optim.AdamW(fused=True) (slower)")
        _torch_step(ps, gs, ms, vs, maxs if amsgrad else None, outs, step, lr, betas, eps, weight_decay,
                    decoupled_weight_decay, maximize)
        return
    threads = num_threads or torch.get_num_threads()
    rc = op.lib.ds_cpu_adam_step(
        n, (ctypes.c_int64 * n)(*numels), _ptrs(ps), _ptrs(gs), _ptrs(ms), _ptrs(vs),
        _ptrs(maxs) if amsgrad else None, _ptrs(outs), _GRAD_CODES[grad_dtype], _OUT_CODES[out_dtype],
        ctypes.byref(hyper), threads,
    )
    if rc != 0:
        raise RuntimeError(f"cpu_adam_step: the op rejected grad dtype {grad_dtype} / copy-out dtype {out_dtype}")


def _torch_step(ps, gs, ms, vs, maxs, outs, step, lr, betas, eps, weight_decay, decoupled, maximize) -> None:
    """The fallback: torch's fused CPU Adam on the same state, then the copy-out."""
    from torch.optim.adam import adam

    grads = [g if g.dtype == torch.float32 else g.float() for g in gs]
    grads = [g.view_as(p) if g.shape != p.shape else g for g, p in zip(grads, ps)]
    views = [t.view_as(p) if t.shape != p.shape else t for t, p in zip(ms, ps)], \
        [t.view_as(p) if t.shape != p.shape else t for t, p in zip(vs, ps)]
    steps = [torch.tensor(float(step - 1)) for _ in ps]  # the fused kernel adds the 1 itself
    adam(ps, grads, views[0], views[1], [t.view_as(p) for t, p in zip(maxs, ps)] if maxs else [], steps,
         fused=True, decoupled_weight_decay=decoupled, amsgrad=maxs is not None, beta1=betas[0], beta2=betas[1],
         lr=lr, weight_decay=weight_decay, eps=eps, maximize=maximize)
    if outs:
        for o, p in zip(outs, ps):
            o.view_as(p).copy_(p)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU tensors through the compiled SIMD op; a drop-in for torch.optim.AdamW.

    Defaults follow AdamW (weight_decay=0.01, decoupled). `decoupled_weight_decay=False`
    gives torch.optim.Adam's L2 form. Parameters must be fp32 CPU tensors (the master
    copy); their .grad may not be sparse. All parameters of a group that share a step
    count go to the op in one call, one parallel region.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = True, num_threads: Optional[int] = None):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"CPUAdam: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"CPUAdam: betas must lie in [0, 1), got {betas}")
        # The keys torch.optim.AdamW writes into every group, so torch can load our state_dict.
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        self.num_threads = num_threads
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if p.device.type != "cpu" or p.dtype != torch.float32:
                    raise TypeError(f"CPUAdam: parameter {i} is {p.dtype} on {p.device}; CPUAdam steps fp32 CPU "
                                    "master parameters (keep a bf16/fp16 device copy and use cpu_adam_step's copy_out)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            amsgrad = group["amsgrad"]
            todo: List[torch.nn.Parameter] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CPUAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                todo.append(p)
            if not todo:
                continue
            steps = [self.state[p]["step"] for p in todo]
            torch._foreach_add_(steps, 1.0)
            # Parameters whose step counts agree share one op call (normally: all of them).
            groups: Dict[int, List[torch.nn.Parameter]] = {}
            for p, s in zip(todo, torch.stack(steps).tolist()):
                groups.setdefault(int(s), []).append(p)
            for step, ps in groups.items():
                states = [self.state[p] for p in ps]
                cpu_adam_step(
                    ps, [p.grad for p in ps], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                    step=step, lr=float(group["lr"]), betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled_weight_decay=group.get("decoupled_weight_decay", True),
                    amsgrad=amsgrad, max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if amsgrad else None,
                    maximize=group.get("maximize", False), num_threads=self.num_threads,
                )
        return loss
