"""fp16 loss scaling: a static scale, or DeepSpeed's dynamic state machine. One scaler.

Dynamic scaling multiplies the loss by `scale` so small fp16 gradients do not flush to
zero. After each optimizer step the engine reports whether any gradient overflowed:

- overflow: the step is skipped. With hysteresis h (`delayed_shift`), the first h-1
  consecutive overflows only use up the hysteresis budget; the h-th halves the scale (never
  below `min_scale`). An overflow while already at `min_scale` cannot be cured by scaling
  and raises LossScaleStuck (unless raise_error_at_min_scale is false: the scale stays).
- Every `scale_window` clean steps after the first clean one since the last overflow double
  the scale (and refill hysteresis), as DeepSpeed 0.19 counts them (tests/runtime/core/test_loss_scaler.py
  holds its sequences). With `consecutive_hysteresis` every clean step refills it.

The classes are DeepSpeed's own (`deepspeed.runtime.fp16.loss_scaler` is this module):
LossScaler and DynamicLossScaler with DeepSpeed's constructors, attribute names and methods
(`update_scale(overflow)`, `loss_scale`, `cur_iter`, `backward(loss)`), so a script driving its
own fp16 loop and the engine use the same object. The engine reads `scale`, reports with
`update(overflow)` and checkpoints `state_dict()`; the optimizer initialize returns carries
the engine's scaler as `loss_scaler` and a LossScaleView of it as `loss_scale_config`, as
DeepSpeed's fp16 and ZeRO wrappers do.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

# DeepSpeed's keys of `dynamic_loss_args` (CreateLossScaler)
INITIAL_LOSS_SCALE = "init_scale"
SCALE_WINDOW = "scale_window"
DELAYED_SHIFT = "delayed_shift"
CONSECUTIVE_HYSTERESIS = "consecutive_hysteresis"
MIN_LOSS_SCALE = "min_scale"


class LossScaleStuck(FloatingPointError):
    pass


@dataclass
class LossScalerState:
    scale: float
    iteration: int = 0
    last_overflow_iter: int = -1
    hysteresis_left: int = 1
    skipped_steps: int = 0


def to_python_float(t) -> float:
    return t.item() if hasattr(t, "item") else t[0]


def has_inf_or_nan(x: torch.Tensor, j=None) -> bool:
    """True if x holds an inf or a NaN (a sum overflows to inf if any element is inf/NaN)."""
    total = float(x.float().sum())
    return math.isinf(total) or math.isnan(total)


class LossScalerBase:
    """DeepSpeed's base of the two scalers: the scale, what a step did, and the loss maths."""

    dynamic = False

    def __init__(self, cur_scale):
        self.state = LossScalerState(scale=float(cur_scale))

    # the scale: the engine's name, and DeepSpeed's two
    scale = property(lambda self: self.state.scale)
    cur_scale = property(lambda self: self.state.scale, lambda self, v: setattr(self.state, "scale", v))
    loss_scale = property(lambda self: self.state.scale)
    cur_iter = property(lambda self: self.state.iteration)  # optimizer steps taken, skipped ones included

    def update(self, overflow: bool) -> None:
        """One optimizer step's outcome (the engine's call)."""
        if overflow:
            self.state.skipped_steps += 1
        self.state.iteration += 1

    def update_scale(self, overflow: bool) -> None:
        """DeepSpeed's name for update."""
        self.update(bool(overflow))

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def scale_loss(self, loss):
        return loss * self.loss_scale

    def backward(self, loss, retain_graph: bool = False) -> None:
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = LossScalerState(**state)


class LossScaler(LossScalerBase):
    """A static loss scale (DeepSpeed's LossScaler). A skipped step is still counted; the
    scale never adapts."""

    def __init__(self, scale=1):
        super().__init__(scale)

    def has_overflow(self, params) -> bool:
        return False


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic scaler: halve on overflow (after `delayed_shift` overflows of
    hysteresis), double after `scale_window` clean steps."""

    dynamic = True

    def __init__(self, init_scale=2 ** 32, scale_window=1000, min_scale=1, delayed_shift=1,
                 consecutive_hysteresis=False, raise_error_at_min_scale=True, dtype=torch.half):
        super().__init__(init_scale)
        self.scale_factor = 2.0
        self.scale_window = int(scale_window)
        self.min_scale = min_scale
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.dtype = dtype
        self.state.hysteresis_left = self.delayed_shift

    last_overflow_iter = property(lambda self: self.state.last_overflow_iter)
    cur_hysteresis = property(lambda self: self.state.hysteresis_left)

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and has_inf_or_nan(p.grad.data) for p in params)

    has_overflow = has_overflow_serial

    def update(self, overflow: bool) -> None:
        s = self.state
        if overflow:
            s.skipped_steps += 1
            if self.delayed_shift == 1 or s.hysteresis_left <= 1:
                if s.scale <= self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleStuck(
                        f"fp16: gradients overflow even at the minimum loss scale {self.min_scale:g} "
                        f"(fp16.min_loss_scale) after {s.skipped_steps} skipped steps; the model has diverged "
                        f"(try a lower learning rate, bf16, or a smaller fp16.min_loss_scale)")
                s.scale = max(s.scale / self.scale_factor, self.min_scale)
            else:
                s.hysteresis_left -= 1
            s.last_overflow_iter = s.iteration
        else:
            if self.consecutive_hysteresis:
                s.hysteresis_left = self.delayed_shift
            # DeepSpeed 0.19's count: the clean steps since the last overflow, not counting
            # the first one after it (so the scale first grows after window + 1 clean steps)
            stable = s.iteration - s.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    s.hysteresis_left = self.delayed_shift
                s.scale *= self.scale_factor
        s.iteration += 1


def make_loss_scaler(fp16_cfg) -> LossScalerBase:
    """From the `fp16` config section; loss_scale 0 means dynamic."""
    if fp16_cfg.loss_scale and fp16_cfg.loss_scale > 0:
        return LossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** fp16_cfg.initial_scale_power, scale_window=fp16_cfg.loss_scale_window,
                             min_scale=float(fp16_cfg.min_loss_scale), delayed_shift=fp16_cfg.hysteresis,
                             consecutive_hysteresis=fp16_cfg.consecutive_hysteresis)


def CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args):
    """DeepSpeed's factory: dynamic scaling for fp16 when asked, else a static scale (1 for
    other dtypes)."""
    if dtype == torch.half and dynamic_scaling:
        if dynamic_loss_args is None:
            raise ValueError("CreateLossScaler: dynamic scaling needs dynamic_loss_args")
        return DynamicLossScaler(dtype=dtype, **dynamic_loss_args)
    return LossScaler(scale=static_loss_scale if dtype == torch.half else 1.0)


class LossScaleView:
    """What DeepSpeed's fp16 optimizer wrappers (FP16_Optimizer, FP16_UnfusedOptimizer) hold
    as `loss_scale_config`, read live from the engine's scaler: `dynamic_loss_scale`,
    `cur_scale` (settable), `cur_iter` (optimizer steps taken, skipped ones included),
    `last_overflow_iter`, `scale_factor`, `scale_window`, `min_loss_scale` (the last four None
    for a static scale, as DeepSpeed's are)."""

    use_grad_scaling = True  # fp16 only: bf16 and fp32 engines have no loss scale

    def __init__(self, scaler: LossScalerBase):
        self._scaler = scaler

    def _dynamic(self, name: str):
        return getattr(self._scaler, name) if self._scaler.dynamic else None

    dynamic_loss_scale = property(lambda self: self._scaler.dynamic)
    cur_scale = property(lambda self: self._scaler.cur_scale, lambda self, v: setattr(self._scaler, "cur_scale", v))
    cur_iter = property(lambda self: self._scaler.cur_iter)
    last_overflow_iter = property(lambda self: self._dynamic("last_overflow_iter"))
    scale_factor = property(lambda self: self._dynamic("scale_factor"))
    scale_window = property(lambda self: self._dynamic("scale_window"))
    min_loss_scale = property(lambda self: self._dynamic("min_scale"))

    def __repr__(self) -> str:
        return (f"LossScaleView(dynamic_loss_scale={self.dynamic_loss_scale}, cur_scale={self.cur_scale}, "
                f"cur_iter={self.cur_iter})")


def expose_on_optimizer(optimizer, scaler: LossScalerBase) -> None:
    """Give the optimizer an fp16 engine returns DeepSpeed's loss-scale attributes: the
    engine's scaler itself as `loss_scaler` (its ZeRO optimizers'), a view of it as
    `loss_scale_config` (its fp16 wrappers'), and `dynamic_loss_scale`. Scripts and
    DeepSpeed's own tests read them from the optimizer deepspeed.initialize returns."""
    optimizer.loss_scale_config = LossScaleView(scaler)
    optimizer.loss_scaler = scaler
    optimizer.dynamic_loss_scale = bool(scaler.dynamic)


__all__ = ["LossScaleView", "expose_on_optimizer", "LossScalerBase", "LossScaler", "DynamicLossScaler", "CreateLossScaler",
           "LossScaleStuck", "LossScalerState", "make_loss_scaler", "has_inf_or_nan", "to_python_float",
           "INITIAL_LOSS_SCALE", "SCALE_WINDOW", "DELAYED_SHIFT", "CONSECUTIVE_HYSTERESIS", "MIN_LOSS_SCALE"]
