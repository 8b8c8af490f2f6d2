"""`deepspeed.runtime.fp16.loss_scaler`: DeepSpeed's loss-scaler classes, as scripts that
drive their own fp16 loop construct and call them (`DynamicLossScaler(init_scale=...,
scale_window=..., ...)`, `update_scale(overflow)`, `loss_scale`, `backward(loss)`).

The state machine is the engine's own (dslaunch.runtime.loss_scaler, which follows DeepSpeed
0.19's counting); these classes only give it DeepSpeed's constructor, attribute names and
methods, so a script's scaler and the engine's never disagree.
"""
from __future__ import annotations

import math

import torch

from ..core.loss_scaler import DynamicLossScaler as _Dynamic
from ..core.loss_scaler import LossScaleStuck
from ..core.loss_scaler import StaticLossScaler as _Static

# DeepSpeed's keys of `dynamic_loss_args` (CreateLossScaler)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


def to_python_float(t) -> float:
    return t.item() if hasattr(t, "item") else t[0]


def has_inf_or_nan(x: torch.Tensor, j=None) -> bool:
    """True if x holds an inf or a NaN (a sum overflows to inf if any element is inf/NaN)."""
    total = float(x.float().sum())
    return math.isinf(total) or math.isnan(total)


class LossScalerBase:
    def __init__(self, cur_scale):
        self._machine = _Static(cur_scale)
        self.dynamic = False

    # the scale lives in the state machine, so a view over the engine's (`over`) reads it live
    cur_scale = property(lambda self: self._machine.state.scale,
                         lambda self, v: setattr(self._machine.state, "scale", v))

    @classmethod
    def over(cls, machine):
        """This class's DeepSpeed interface over an existing state machine (the engine's
        scaler), sharing its state: what DeepSpeed's ZeRO optimizer holds as `loss_scaler`."""
        view = cls.__new__(cls)
        view._machine = machine
        view.dynamic = machine.dynamic
        if machine.dynamic:
            view.scale_factor = machine.factor
            view.scale_window = machine.window
            view.min_scale = machine.min_scale
            view.delayed_shift = machine.hysteresis
            view.consecutive_hysteresis = machine.consecutive_hysteresis
            view.raise_error_at_min_scale = machine.raise_at_min_scale
            view.dtype = torch.half
        return view

    @property
    def loss_scale(self):
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def update_scale(self, overflow: bool) -> None:
        pass

    def scale_loss(self, loss):
        return loss * self.loss_scale

    def backward(self, loss, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)


class LossScaler(LossScalerBase):
    """A static loss scale."""

    def __init__(self, scale=1):
        super().__init__(scale)

    def has_overflow(self, params) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic scaler: halve on overflow (after `delayed_shift` overflows of
    hysteresis), double after `scale_window` clean steps. Overflow at `min_scale` raises
    LossScaleStuck when raise_error_at_min_scale, else the scale stays there."""

    def __init__(self, init_scale=2 ** 32, scale_window=1000, min_scale=1, delayed_shift=1,
                 consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.half):
        self._machine = _Dynamic(window=int(scale_window), hysteresis=int(delayed_shift), min_scale=min_scale,
                                 consecutive_hysteresis=bool(consecutive_hysteresis),
                                 raise_at_min_scale=bool(raise_error_at_min_scale))
        self._machine.state.scale = init_scale
        self.scale_factor = self._machine.factor
        self.scale_window = int(scale_window)
        self.min_scale = min_scale
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.dynamic = True
        self.dtype = dtype

    # DeepSpeed's attribute names, read from (and written to) the one state machine
    cur_iter = property(lambda self: self._machine.state.iteration)
    last_overflow_iter = property(lambda self: self._machine.state.last_overflow_iter)
    cur_hysteresis = property(lambda self: self._machine.state.hysteresis_left)

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and has_inf_or_nan(p.grad.data) for p in params)

    has_overflow = has_overflow_serial

    def update_scale(self, overflow: bool) -> None:
        self._machine.update(bool(overflow))


class LossScaleView:
    """What DeepSpeed's fp16 optimizer wrappers (FP16_Optimizer, FP16_UnfusedOptimizer) hold
    as `loss_scale_config`, read live from the engine's scaler: `dynamic_loss_scale`,
    `cur_scale` (settable), `cur_iter` (optimizer steps taken, skipped ones included),
    `last_overflow_iter`, `scale_factor`, `scale_window`, `min_loss_scale` (the last four None
    for a static scale, as DeepSpeed's are)."""

    use_grad_scaling = True  # fp16 only: bf16 and fp32 engines have no loss scale

    def __init__(self, machine):
        self._machine = machine

    dynamic_loss_scale = property(lambda self: self._machine.dynamic)
    cur_scale = property(lambda self: self._machine.state.scale,
                         lambda self, v: setattr(self._machine.state, "scale", v))
    cur_iter = property(lambda self: self._machine.state.iteration)
    last_overflow_iter = property(lambda self: self._machine.state.last_overflow_iter
                                  if self._machine.dynamic else None)
    scale_factor = property(lambda self: self._machine.factor if self._machine.dynamic else None)
    scale_window = property(lambda self: self._machine.window if self._machine.dynamic else None)
    min_loss_scale = property(lambda self: self._machine.min_scale if self._machine.dynamic else None)

    def __repr__(self) -> str:
        return (f"LossScaleView(dynamic_loss_scale={self.dynamic_loss_scale}, cur_scale={self.cur_scale}, "
                f"cur_iter={self.cur_iter})")


def expose_on_optimizer(optimizer, machine) -> None:
    """Give the optimizer an fp16 engine returns DeepSpeed's loss-scale attributes, all views
    of the engine's one scaler: `loss_scale_config` (its fp16 wrappers'), `loss_scaler` and
    `dynamic_loss_scale` (its ZeRO optimizers'). Scripts and DeepSpeed's own tests read them
    from the optimizer deepspeed.initialize returns."""
    optimizer.loss_scale_config = LossScaleView(machine)
    optimizer.loss_scaler = (DynamicLossScaler if machine.dynamic else LossScaler).over(machine)
    optimizer.dynamic_loss_scale = bool(machine.dynamic)


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args):
    """DeepSpeed's factory: dynamic scaling for fp16 when asked, else a static scale (1 for
    other dtypes)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("CreateLossScaler: dynamic scaling needs dynamic_loss_args")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


__all__ = ["LossScaleView", "expose_on_optimizer", "LossScalerBase", "LossScaler", "DynamicLossScaler", "CreateLossScaler", "LossScaleStuck",
           "has_inf_or_nan", "to_python_float", "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT",
           "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE"]
