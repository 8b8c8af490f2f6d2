"""Rank 0's progress line, one metrics sink among the others (runtime/train/monitor/).

Every `steps_per_print` steps: the step (with the total and an ETA when the run's total
is known: engine.set_train_steps(n), or a scheduler with total_num_steps; else the position
in the epoch of initialize()'s data loader, and no ETA: an epoch's end is not the run's), the loss as the mean over the window's steps (labelled so), lr, samples/s, loss
scale (fp16), skipped steps, and the per-step phase times with `wall_clock_breakdown`.
On a terminal it is printed through rich (styled, aligned); in a pipe or a log file it is
plain text, so logs stay grep-able:

    step 20/200 | loss 2.3456 (mean of 10 steps) | lr 1.000e-03 | 812.3 samples/s | ETA 0:01:02 | skipped 0
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .monitor.sink import LOSS_SCALE, LR, TIMER_EVENT, TRAIN_LOSS, MetricsSink, StepRecord
from .monitor.meter import TIMERS


@dataclass
class Window:
    losses: List[float] = field(default_factory=list)
    steps: int = 0
    first_samples: Optional[int] = None
    started: float = field(default_factory=time.perf_counter)
    timers: Dict[str, float] = field(default_factory=dict)


def clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLog(MetricsSink):
    name = "progress"

    def __init__(self, steps_per_print: int, enabled: bool, wall_clock_breakdown: bool = False, stream=None,
                 throughput: bool = True):
        self.every = steps_per_print
        self.enabled = enabled
        self.breakdown = wall_clock_breakdown
        self.throughput = throughput
        self.stream = stream or sys.stdout
        self.window = Window()
        self._samples_before: Optional[int] = None
        self._console = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)

    def write_step(self, record: StepRecord) -> Optional[str]:
        w = self.window
        if w.first_samples is None:
            w.first_samples = self._samples_before if self._samples_before is not None else 0
        self._samples_before = record.samples
        w.steps += 1
        if TRAIN_LOSS in record.values:
            w.losses.append(record.values[TRAIN_LOSS])
        for name in TIMERS:
            key = TIMER_EVENT.format(name)
            if key in record.values:
                w.timers[name] = w.timers.get(name, 0.0) + record.values[key]
        if record.alert and self.enabled:  # said at once, whatever steps_per_print is
            print(f"step {record.step} | {record.alert}", file=self.stream, flush=True)
        if record.step % self.every:
            return None
        line, styled = self._line(record)
        if self.enabled:
            if self._console is not None:
                self._console.print(styled)
            else:
                print(line, file=self.stream, flush=True)
        self.window = Window()
        return line

    def _line(self, record: StepRecord):
        w = self.window
        elapsed = max(time.perf_counter() - w.started, 1e-9)
        per_step = elapsed / w.steps
        where = f"step {record.step}"
        eta = None
        if record.total_steps:
            where += f"/{record.total_steps}"
            eta = (record.total_steps - record.step) * per_step
        elif record.epoch_steps:
            epoch = (record.step - 1) // record.epoch_steps  # the epoch this step belongs to
            into = record.step - epoch * record.epoch_steps
            where += f" (epoch {epoch} {into}/{record.epoch_steps})"
        loss = sum(w.losses) / len(w.losses) if w.losses else float("nan")
        loss_text = f"loss {loss:.4f} (mean of {w.steps} step{'s' if w.steps != 1 else ''})"
        parts = [where, loss_text, f"lr {record.values.get(LR, 0.0):.3e}"]
        if self.throughput:
            parts.append(f"{(record.samples - (w.first_samples or 0)) / elapsed:.1f} samples/s")
        if eta is not None:
            parts.append(f"ETA {clock(eta)}")
        if LOSS_SCALE in record.values:
            parts.append(f"loss scale {record.values[LOSS_SCALE]:g}")
        parts.append(f"skipped {record.skipped}")
        if self.breakdown and w.timers:
            parts.append(" ".join(f"{k} {v / w.steps:.1f}ms" for k, v in w.timers.items()))
        line = " | ".join(parts)
        styled = f"[bold cyan]{where:>12}[/] [green]{loss_text}[/] | " + " | ".join(parts[2:])
        return line, styled
