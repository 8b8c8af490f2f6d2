"""FusedAdam: multi-tensor Adam/AdamW on CUDA through fused_adam.cu, as torch ops.

One kernel launch steps every tensor of a parameter group that shares a (parameter dtype,
gradient dtype) pair. The op (fused_adam_op.cpp, built with the kernels by
torch.utils.cpp_extension) takes the tensors themselves, checks them at the boundary
(CUDA, one device, dtype, contiguity, sizes: one error naming the argument), writes the
table of their pointers to the device on the current stream and launches. Step counts are
device tensors (as in torch's fused/capturable AdamW) that the kernel itself increments,
so a step issues no host synchronisation at all. The ops have fake implementations (the
same checks, no computation), so torch.compile can trace a step.

AMP: like torch's fused optimizers, `grad_scale` and `found_inf` are read from the
attributes torch.amp.GradScaler sets around step() (or passed to step()); the kernel divides gradients by *grad_scale and skips
the update (step counts included) when *found_inf is non-zero. `skip_nonfinite=True`
makes the optimizer run its own multi-tensor inf/NaN check first when no found_inf is
given (e.g. under a hand-written loss scaler): one verdict for the whole step, every group
and dtype, on the device; the torch fallback honours it the same way.

States are fp32 whatever the parameter dtype (fp32, bf16, fp16); the state_dict has
torch.optim.AdamW's keys. `cpu_params=True` (what `deepspeed.ops.adam.FusedAdam` passes, as
DeepSpeed's CPU accelerator builds its FusedAdam from its CPU Adam kernel) also steps CPU
parameters, with the CPU Adam op: the same maths and state, bf16/fp16 rounded back. Without a usable CUDA op the step falls back to torch's Adam
kernels with one warning.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import builder, torch_ops
from .loader import LazyOp

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_list(op: str, name: str, ts: Sequence[torch.Tensor], device: torch.device, numels: List[int],
                dtype: torch.dtype, optional: bool = False) -> None:
    """What fused_adam_op.cpp checks of a tensor list, on (fake) tensors, in its words."""
    if optional and not ts:
        return
    if len(ts) != len(numels):
        raise RuntimeError(f"{op}: {len(numels)} params but {len(ts)} {name}")
    for i, t in enumerate(ts):
        if t.device.type != "cuda":
            raise RuntimeError(f"{op}: {name}[{i}] is not on a CUDA device; the fused op needs CUDA tensors")
        if t.device != device:
            raise RuntimeError(f"{op}: {name}[{i}] is on {t.device}, params[0] on {device}; one call steps one device")
        if t.dtype != dtype:
            raise RuntimeError(f"{op}: {name}[{i}] has dtype {_name(t.dtype)}; expected {_name(dtype)}")
        if t.numel() != numels[i]:
            raise RuntimeError(f"{op}: {name}[{i}] has {t.numel()} elements, the parameter has {numels[i]}")
        if not t.is_contiguous():
            raise RuntimeError(f"{op}: {name}[{i}] is not contiguous; the update would be lost in a copy")


def _check_scalar(op: str, name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> None:
    if t.device != device or t.dtype != dtype or t.numel() != 1:
        raise RuntimeError(f"{op}: {name} must be one {_name(dtype)} element on {device} "
                           f"(got {_name(t.dtype)}, {t.numel()} elements, on {t.device})")


def _first(op: str, name: str, ts: Sequence[torch.Tensor]) -> Tuple[torch.device, torch.dtype]:
    if ts[0].device.type != "cuda":
        raise RuntimeError(f"{op}: {name}[0] is not on a CUDA device; the fused op needs CUDA tensors")
    if ts[0].dtype not in _DTYPES:
        raise RuntimeError(f"{op}: {name}[0] has dtype {_name(ts[0].dtype)}; expected float32, bfloat16 or float16")
    return ts[0].device, ts[0].dtype


def _fake_adam_step(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, done, grad_scale, found_inf, lr,
                    beta1, beta2, eps, weight_decay, decoupled, amsgrad, maximize, bias_correction) -> None:
    """adam_step on fake tensors (torch.compile): the op's checks, no computation."""
    op = "fused adam_step"
    if not params:
        return
    device, p_dtype = _first(op, "params", params)
    numels = [p.numel() for p in params]
    _check_list(op, "params", params, device, numels, p_dtype)
    if not grads:
        raise RuntimeError(f"{op}: {len(params)} params but 0 grads")
    _check_list(op, "grads", grads, device, numels, _first(op, "grads", grads)[1])
    for name, ts in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        _check_list(op, name, ts, device, numels, torch.float32)
    if amsgrad and not max_exp_avg_sqs:
        raise RuntimeError(f"{op}: amsgrad=True needs max_exp_avg_sqs")
    _check_list(op, "max_exp_avg_sqs", max_exp_avg_sqs, device, numels, torch.float32, optional=True)
    if len(steps) != len(params):
        raise RuntimeError(f"{op}: {len(params)} params but {len(steps)} steps")
    for i, s in enumerate(steps):
        _check_scalar(op, f"steps[{i}]", s, device, torch.float32)
    _check_scalar(op, "done", done, device, torch.int32)
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is not None:
            _check_scalar(op, name, t, device, torch.float32)


def _fake_nonfinite(grads, found_inf) -> None:
    """nonfinite on fake tensors: the op's checks."""
    op = "fused nonfinite"
    if not grads:
        return
    device, g_dtype = _first(op, "grads", grads)
    _check_list(op, "grads", grads, device, [g.numel() for g in grads], g_dtype)
    _check_scalar(op, "found_inf", found_inf, device, torch.float32)


@dataclass(frozen=True)
class FusedOps:
    """The library's two torch ops."""

    adam_step: object
    nonfinite: object


def _bind(lib: ctypes.CDLL) -> FusedOps:
    return FusedOps(torch_ops.register(lib, "ds_fused_adam", "adam_step", _fake_adam_step),
                    torch_ops.register(lib, "ds_fused_adam", "nonfinite", _fake_nonfinite))


def _no_cuda() -> Optional[str]:
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


_OP = LazyOp("FusedAdam", builder.fused_adam_spec, _bind, _no_cuda)


def fused_adam_available() -> bool:
    """True when a CUDA device is present and the fused op is built (building it on first call)."""
    return _OP.load()


class _Bucket:
    """Tensors stepped by one launch."""

    def __init__(self):
        self.params: List[torch.Tensor] = []
        self.grads: List[torch.Tensor] = []

    @property
    def empty(self) -> bool:
        return all(p.numel() == 0 for p in self.params)


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW over CUDA parameters in one kernel launch per dtype pair; AdamW-compatible state."""

    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 decoupled_weight_decay: bool = True, bias_correction: bool = True, skip_nonfinite: bool = False,
                 cpu_params: bool = False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"FusedAdam: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"FusedAdam: betas must lie in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=None, capturable=False, differentiable=False, fused=None,
                        decoupled_weight_decay=decoupled_weight_decay)
        if not bias_correction:  # DeepSpeed's option; the key stays out of torch-compatible groups otherwise
            defaults["bias_correction"] = False
        super().__init__(params, defaults)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                on_cpu = cpu_params and p.device.type == "cpu"
                if (p.device.type != "cuda" and not on_cpu) or p.dtype not in _DTYPES:
                    raise TypeError(f"FusedAdam: parameter {i} is {p.dtype} on {p.device}; FusedAdam steps CUDA "
                                    "fp32/bf16/fp16 parameters (use dslaunch.kernels.CPUAdam on the CPU)")
        self.skip_nonfinite = skip_nonfinite
        self.cpu_params = cpu_params
        self._aux: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def describe(self) -> str:
        """What steps the parameters (the engine's start-up line shows it)."""
        devices = {p.device.type for g in self.param_groups for p in g["params"]}
        parts = []
        if devices - {"cpu"} or not devices:
            parts.append(f"dslaunch FusedAdam (CUDA, {_OP.built.isa})" if _OP.load()
                         else "torch's Adam kernels (the dslaunch FusedAdam op is unavailable)")
        if "cpu" in devices:
            from .cpu_adam import _OP as CPU_OP

            parts.append(f"dslaunch CPU Adam ({CPU_OP.built.isa}) for CPU parameters" if CPU_OP.load()
                         else "torch's fused CPU Adam (the dslaunch CPU Adam op is unavailable)")
        return "; ".join(parts)

    def _state_for(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        # A state_dict from torch (or a CPU run) may carry a host step and param-dtype states.
        if state["step"].device != p.device or state["step"].dtype != torch.float32:
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32).reshape(())
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state and (state[key].dtype != torch.float32 or not state[key].is_contiguous()):
                state[key] = state[key].float().contiguous()
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        return state

    @torch.no_grad()
    def step(self, closure=None, grad_scale: Optional[torch.Tensor] = None, found_inf: Optional[torch.Tensor] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler sets these attributes around step() for fused optimizers.
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        usable = None  # the CUDA op, loaded when a CUDA parameter is stepped
        work = []  # (group, (device, param dtype, grad dtype), bucket) for the whole step
        for group in self.param_groups:
            amsgrad = group["amsgrad"]
            buckets: Dict[tuple, _Bucket] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                if not p.is_contiguous():
                    raise ValueError("FusedAdam: a parameter is not contiguous; its update would be lost in a copy")
                self._state_for(p, amsgrad)
                b = buckets.setdefault((p.device, p.dtype, g.dtype), _Bucket())
                b.grads.append(g)  # a contiguous copy must outlive the launch
                b.params.append(p)
            work += [(group, key, bucket) for key, bucket in buckets.items()]
        if any(device.type == "cuda" for _, (device, _, _), _ in work):
            usable = _OP.load()
            if not usable:
                _OP.warn_fallback("torch's Adam kernels", stacklevel=3)
        # skip_nonfinite: one verdict for the whole step (every group and dtype), as GradScaler's
        # found_inf is, so a NaN in one bucket never lets the others step alone.
        flags = self._nonfinite_flags(work, usable) if found_inf is None and self.skip_nonfinite else None
        for group, (device, p_dtype, g_dtype), bucket in work:
            skip = flags[device] if flags is not None else found_inf
            if device.type == "cpu":
                self._cpu_step(group, bucket, grad_scale, skip)
            elif usable:
                self._launch(group, bucket, device, p_dtype, g_dtype, grad_scale, skip)
            else:
                self._fallback(group, bucket, grad_scale, skip)
        return loss

    def _nonfinite_flags(self, work, usable: bool) -> Dict[torch.device, torch.Tensor]:
        """Per device a float32 [1] that is 1 when any gradient of the step is inf/NaN,
        computed on the device without a host sync (the kernel; torch ops in the fallback)."""
        flags: Dict[torch.device, torch.Tensor] = {}
        for _, (device, _, g_dtype), bucket in work:
            if device not in flags:
                flags[device] = self._aux_for(device)[1]
                flags[device].zero_()
            if bucket.empty:
                continue
            if usable and device.type == "cuda":
                _OP.torch_op.nonfinite(bucket.grads, flags[device])
            else:
                for g in bucket.grads:
                    flags[device].copy_(torch.maximum(flags[device], (~torch.isfinite(g)).any().float().reshape(1)))
        if len(flags) > 1:  # one verdict across devices too
            first = next(iter(flags))
            worst = torch.stack([f.to(first) for f in flags.values()]).amax(0)
            for device, f in flags.items():
                f.copy_(worst.to(device))
        return flags

    def _aux_for(self, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """The launch counter the kernel's last block re-arms, and our own found_inf flag."""
        if device not in self._aux:
            self._aux[device] = (torch.zeros(1, dtype=torch.int32, device=device),
                                 torch.zeros(1, dtype=torch.float32, device=device))
        return self._aux[device]

    def _launch(self, group, bucket: _Bucket, device, p_dtype, g_dtype, grad_scale, found_inf) -> None:
        states = [self.state[p] for p in bucket.params]
        steps = [st["step"] for st in states]
        if bucket.empty:  # only empty tensors: nothing to compute, but the counts still advance
            if found_inf is None:
                torch._foreach_add_(steps, 1.0)
            else:
                torch._foreach_add_(steps, 1.0 - (found_inf != 0).float())
            return
        b1, b2 = group["betas"]
        self._device_scalar(grad_scale, device)
        self._device_scalar(found_inf, device)
        _OP.torch_op.adam_step(
            bucket.params, bucket.grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
            [st["max_exp_avg_sq"] for st in states] if group["amsgrad"] else [], steps, self._aux_for(device)[0],
            grad_scale, found_inf, float(group["lr"]), float(b1), float(b2), float(group["eps"]),
            float(group["weight_decay"]), bool(group.get("decoupled_weight_decay", True)), bool(group["amsgrad"]),
            bool(group.get("maximize", False)), bool(group.get("bias_correction", True)))

    def _cpu_step(self, group, bucket: _Bucket, grad_scale, found_inf) -> None:
        """CPU parameters (cpu_params=True, as DeepSpeed's CPU accelerator builds its FusedAdam
        from its CPU Adam kernel): the CPU Adam op, the same maths and state; a bf16/fp16
        parameter is stepped on an fp32 copy and written back rounded in the op's pass."""
        from .cpu_adam import cpu_adam_step

        if found_inf is not None and bool(found_inf.item()):
            return
        states = [self.state[p] for p in bucket.params]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1.0)
        if bucket.empty:
            return
        low = bucket.params[0].dtype != torch.float32
        params = [p.detach().float() if low else p.detach() for p in bucket.params]
        grads = bucket.grads if grad_scale is None else [g.float() / grad_scale for g in bucket.grads]
        b1, b2 = group["betas"]
        cpu_adam_step(params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                      step=steps, lr=float(group["lr"]), betas=(b1, b2), eps=group["eps"],
                      weight_decay=group["weight_decay"],
                      decoupled_weight_decay=group.get("decoupled_weight_decay", True), amsgrad=group["amsgrad"],
                      max_exp_avg_sqs=[st["max_exp_avg_sq"] for st in states] if group["amsgrad"] else None,
                      maximize=group.get("maximize", False), bias_correction=group.get("bias_correction", True),
                      copy_out=[p.detach() for p in bucket.params] if low else None)

    @staticmethod
    def _device_scalar(t: Optional[torch.Tensor], device) -> None:
        if t is not None and (t.device != device or t.dtype != torch.float32 or t.numel() != 1):
            raise ValueError(f"FusedAdam: grad_scale/found_inf must be one float32 element on {device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")

    def _fallback(self, group, bucket: _Bucket, grad_scale, found_inf) -> None:
        """torch's own single-tensor Adam on fp32 views of the same state, skipped as the
        kernel skips (found_inf set, by the caller or by skip_nonfinite's check); reading
        the flag costs a host sync here, which the kernel path avoids."""
        from torch.optim.adam import adam

        if not group.get("bias_correction", True):
            raise RuntimeError(f"FusedAdam: bias_correction=False needs the CUDA op, which is unavailable: {_OP.error}")
        if found_inf is not None and bool(found_inf.item()):
            return
        for p in bucket.params:
            st = self.state[p]
            p32 = p.detach().float()
            g32 = p.grad.float()
            if grad_scale is not None:
                g32 = g32 / grad_scale
            b1, b2 = group["betas"]
            adam([p32], [g32], [st["exp_avg"]], [st["exp_avg_sq"]],
                 [st["max_exp_avg_sq"]] if group["amsgrad"] else [], [st["step"]], foreach=False,
                 capturable=p.device.type == "cuda", decoupled_weight_decay=group.get("decoupled_weight_decay", True),
                 amsgrad=group["amsgrad"], beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=group.get("maximize", False))
            if p32.data_ptr() != p.data_ptr():
                p.copy_(p32)
