"""What the engine measures during one optimizer step, turned into a StepRecord.

The engine reports each micro-step's loss and, with `wall_clock_breakdown`, the time of
each phase; at the boundary `record()` yields DeepSpeed's events for the step:
train_loss (mean of this step's micro-batch losses on rank 0), lr, loss_scale (fp16)
and the elapsed_time_ms_* timers.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Optional

import torch

from .sink import LOSS_SCALE, LR, TIMER_EVENT, TRAIN_LOSS, StepRecord

TIMERS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


class StepMeter:
    def __init__(self, breakdown: bool, synchronize: bool):
        self.breakdown = breakdown
        self.synchronize = synchronize and torch.cuda.is_available()
        self._loss_sum = 0.0
        self._loss_count = 0
        self._times: Dict[str, float] = {}
        self._started: Dict[str, float] = {}

    def add_loss(self, value) -> None:
        """A float, or a detached 0-d tensor: summed on its device and read once in
        record(), so micro-steps add no device synchronisation."""
        self._loss_sum = self._loss_sum + value
        self._loss_count += 1

    @contextlib.contextmanager
    def timed(self, name: str):
        if not self.breakdown:
            yield
            return
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def begin(self, name: str) -> None:
        """Start timing `name` where no `with` block can span it (a backward pass the script
        starts itself: its first gradient begins it, the epilogue ends it)."""
        if self.breakdown:
            self._sync()
            self._started[name] = time.perf_counter()

    def end(self, name: str) -> None:
        start = self._started.pop(name, None)
        if start is not None:
            self._sync()
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize()

    def record(self, step: int, samples: int, lr: float, loss_scale: Optional[float], skipped: int,
               total_steps: Optional[int] = None, epoch_steps: Optional[int] = None) -> StepRecord:
        values: Dict[str, float] = {}
        if self._loss_count:
            values[TRAIN_LOSS] = float(self._loss_sum) / self._loss_count
        values[LR] = lr
        if loss_scale is not None:
            values[LOSS_SCALE] = loss_scale
        if self.breakdown:
            for name in TIMERS:
                values[TIMER_EVENT.format(name)] = self._times.get(name, 0.0) * 1000.0
        self._loss_sum, self._loss_count, self._times = 0.0, 0, {}
        return StepRecord(step=step, samples=samples, values=values, skipped=skipped, total_steps=total_steps,
                          epoch_steps=epoch_steps)
