"""`engine.tput_timer`: DeepSpeed's throughput timer, with DeepSpeed's counters.

The engine starts it at each forward and stops it at each step() (a micro-step; the boundary
counts a global step). The first `start_step` global steps are warm-up: their time is not
counted, so `avg_samples_per_sec()` is the train batch size over the mean time of the global
steps after them. `timers.throughput.enabled: false` turns it off (start and stop do
nothing); `synchronized` waits for the GPU before each clock reading.

Rank 0's progress line (progress.py) is the report; this object only measures, for scripts
that read it (DeepSpeed's ThroughputTimer also logs at steps_per_print, which the progress
line does here).
"""
from __future__ import annotations

import time

import torch


class ThroughputTimer:
    def __init__(self, config, batch_size=None, start_step: int = 2):
        self.enabled = bool(config.enabled)
        self.synchronized = bool(config.synchronized)
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.initialized = False  # any start() so far
        self.started = False  # between a start() and its stop()
        self.start_time = 0.0  # 0 while warming up: nothing is being timed
        self.end_time = 0.0
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0  # the timed micro-steps after warm-up
        self.step_elapsed_time = 0.0  # the timed micro-steps of the global step in progress

    def _clock(self) -> float:
        if self.synchronized and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.time()

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._clock()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Ends a micro-step; `global_step`: it closed a global step. report_speed is
        DeepSpeed's switch for its log line, which the progress line replaces here."""
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time > 0:
            self.end_time = self._clock()
            duration = self.end_time - self.start_time
            self.total_elapsed_time += duration
            self.step_elapsed_time += duration
            if global_step:
                self.step_elapsed_time = 0.0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the global steps after warm-up; -inf before any was timed
        (DeepSpeed's answer before any global step; at the first timed one it divides by zero)."""
        timed = self.global_step_count - self.start_step
        if timed <= 0 or self.total_elapsed_time <= 0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed)
