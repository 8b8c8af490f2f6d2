"""Rank 0's training log: every `steps_per_print` steps, one line with step, loss, lr,
samples/s, loss scale and skipped steps. On a terminal it is printed through rich (styled,
aligned); in a pipe or a log file it is plain text, so logs stay grep-able.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class StepWindow:
    losses: float = 0.0
    loss_count: int = 0
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)
    timers: Dict[str, float] = field(default_factory=dict)


class ProgressLog:
    def __init__(self, steps_per_print: int, enabled: bool, wall_clock_breakdown: bool = False, stream=None):
        self.every = steps_per_print
        self.enabled = enabled
        self.breakdown = wall_clock_breakdown
        self.stream = stream or sys.stdout
        self.window = StepWindow()
        self._console = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)

    def add_loss(self, value: float) -> None:
        self.window.losses += value
        self.window.loss_count += 1

    def add_time(self, name: str, seconds: float) -> None:
        self.window.timers[name] = self.window.timers.get(name, 0.0) + seconds

    def step_done(self, step: int, samples: int, lr: float, loss_scale: Optional[float], skipped: int) -> Optional[str]:
        w = self.window
        w.samples += samples
        if step % self.every:
            return None
        elapsed = max(time.perf_counter() - w.started, 1e-9)
        loss = w.losses / w.loss_count if w.loss_count else float("nan")
        parts = [f"step {step}", f"loss {loss:.4f}", f"lr {lr:.3e}", f"{w.samples / elapsed:.1f} samples/s"]
        if loss_scale is not None:
            parts.append(f"loss scale {loss_scale:g}")
        parts.append(f"skipped {skipped}")
        line = " | ".join(parts)
        if self.breakdown and w.timers:
            line += " | " + " ".join(f"{k} {v * 1000 / self.every:.1f}ms" for k, v in sorted(w.timers.items()))
        if self.enabled:
            if self._console is not None:
                self._console.print(f"[bold cyan]step {step:>6}[/] [green]loss {loss:.4f}[/] " + " | ".join(parts[2:])
                                    + (line[len(" | ".join(parts)):] if self.breakdown else ""))
            else:
                print(line, file=self.stream, flush=True)
        self.window = StepWindow()
        return line
