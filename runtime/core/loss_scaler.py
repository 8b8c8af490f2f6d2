"""fp16 loss scaling: a static scale, or DeepSpeed's dynamic state machine.

Dynamic scaling multiplies the loss by `scale` so small fp16 gradients do not flush to
zero. After each optimizer step the engine reports whether any gradient overflowed:

- overflow: the step is skipped. With hysteresis h, the first h-1 consecutive overflows
  only use up the hysteresis budget; the h-th halves the scale (never below
  `min_scale`). An overflow while already at `min_scale` cannot be cured by scaling and
  raises LossScaleStuck.
- Every `window` clean steps after the first clean one since the last overflow double the
  scale (and refill hysteresis), as DeepSpeed 0.19 counts them (tests/test_loss_scaler.py
  holds its sequences). With `consecutive_hysteresis` every clean step refills it.

Pure logic, no torch: the engine decides "overflow" from the global gradient norm.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


class LossScaleStuck(FloatingPointError):
    pass


@dataclass
class LossScalerState:
    scale: float
    iteration: int = 0
    last_overflow_iter: int = -1
    hysteresis_left: int = 1
    skipped_steps: int = 0


class StaticLossScaler:
    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.state = LossScalerState(scale=float(scale))

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, overflow: bool) -> None:
        # A static scale still skips steps with inf/nan gradients; it never adapts.
        if overflow:
            self.state.skipped_steps += 1
        self.state.iteration += 1

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        self.state = LossScalerState(**state)


class DynamicLossScaler(StaticLossScaler):
    dynamic = True

    def __init__(self, initial_scale_power: int = 16, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0, consecutive_hysteresis: bool = False, factor: float = 2.0,
                 raise_at_min_scale: bool = True):
        super().__init__(2.0 ** initial_scale_power)
        self.raise_at_min_scale = raise_at_min_scale
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = factor
        self.state.hysteresis_left = hysteresis

    def update(self, overflow: bool) -> None:
        s = self.state
        if overflow:
            s.skipped_steps += 1
            if self.hysteresis == 1 or s.hysteresis_left <= 1:
                if s.scale <= self.min_scale and self.raise_at_min_scale:
                    raise LossScaleStuck(
                        f"fp16: gradients overflow even at the minimum loss scale {self.min_scale:g} "
                        f"(fp16.min_loss_scale) after {s.skipped_steps} skipped steps; the model has diverged "
                        f"(try a lower learning rate, bf16, or a smaller fp16.min_loss_scale)")
                s.scale = max(s.scale / self.factor, self.min_scale)
            else:
                s.hysteresis_left -= 1
            s.last_overflow_iter = s.iteration
        else:
            if self.consecutive_hysteresis:
                s.hysteresis_left = self.hysteresis
            # DeepSpeed 0.19's count: the clean steps since the last overflow, not counting
            # the first one after it (so the scale first grows after window + 1 clean steps)
            stable = s.iteration - s.last_overflow_iter - 1
            if stable > 0 and stable % self.window == 0:
                if not self.consecutive_hysteresis:
                    s.hysteresis_left = self.hysteresis
                s.scale *= self.factor
        s.iteration += 1


def make_loss_scaler(fp16_cfg) -> StaticLossScaler:
    """From the `fp16` config section; loss_scale 0 means dynamic."""
    if fp16_cfg.loss_scale and fp16_cfg.loss_scale > 0:
        return StaticLossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(initial_scale_power=fp16_cfg.initial_scale_power, window=fp16_cfg.loss_scale_window,
                             hysteresis=fp16_cfg.hysteresis, min_scale=fp16_cfg.min_loss_scale,
                             consecutive_hysteresis=fp16_cfg.consecutive_hysteresis)
