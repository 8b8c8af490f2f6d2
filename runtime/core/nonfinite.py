"""Non-finite steps in fp32 and bf16 (config `nonfinite_check`).

fp16 has the loss scaler: an overflow skips the step and lowers the scale. fp32 and bf16
have nothing of the kind in DeepSpeed: one NaN gradient is applied, the weights become
NaN, and the log goes on saying "skipped 0". Here, at every optimizer step, the global
gradient norm (the same number on every rank: it is taken over the reduced gradients) is
checked; when it is NaN or infinite the update is skipped, the progress line says so at
once, and after `max_consecutive_steps` such steps in a row training stops with one line
naming the steps. A finite step resets the count.

The check reads the norm once per optimizer step, at the boundary, where clipping reads it
too; the loss (rank 0's mean over the step's micro-batches) is read there as well, so no
device synchronisation is added on micro-steps. A non-finite loss whose gradients are
finite is only reported: skipping on a rank-local value could let ranks disagree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


class NonFiniteError(RuntimeError):
    """Training stopped after too many consecutive non-finite steps (one line)."""


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:g}"


@dataclass
class NonFiniteGuard:
    max_consecutive_steps: int
    streak: int = 0
    first: Optional[int] = None  # the first step of the current streak
    total: int = 0

    def observe(self, step: int, grad_norm: Optional[float], loss: Optional[float]) -> Optional[str]:
        """Step `step` finished with this norm and loss; returns the alert for the progress
        line, or None when both are finite."""
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)
        bad_loss = loss is not None and not math.isfinite(loss)
        if not bad_norm:
            self.streak, self.first = 0, None
            if bad_loss:
                return f"non-finite loss ({_fmt(loss)}) with a finite gradient norm: update applied"
            return None
        self.total += 1
        self.streak += 1
        if self.first is None:
            self.first = step
        return (f"non-finite gradient norm ({_fmt(grad_norm)}, loss {_fmt(loss)}): update skipped "
                f"({self.streak} of {self.max_consecutive_steps} in a row allowed)")

    def check(self, step: int) -> None:
        if self.streak >= self.max_consecutive_steps:
            steps = f"step {step}" if self.first == step else f"steps {self.first}-{step}"
            raise NonFiniteError(
                f"training stopped at step {step}: the gradient norm was NaN or infinite for {self.streak} "
                f"consecutive steps ({steps}); the weights are those after step {self.first - 1}. Lower the "
                f"learning rate or check the data, or raise nonfinite_check.max_consecutive_steps")
