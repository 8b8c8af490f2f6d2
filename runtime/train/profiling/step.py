"""The engine's side of `flops_profiler`: profile every forward of the step whose number
of completed steps equals `profile_step` (DeepSpeed's rule: profile_step warm-up steps
run first), on rank 0, and print the profile with that step's forward/backward/step
latencies when the step ends."""
from __future__ import annotations

import contextlib

from ..monitor.sink import TIMER_EVENT
from .flops_profiler import FlopsProfiler
from .report import StepTimes


class StepProfiler:
    def __init__(self, cfg, model, rank: int):
        self.cfg = cfg
        self.active = cfg.enabled and rank == 0
        self.profiler = FlopsProfiler(model, recompute_fwd_factor=cfg.recompute_fwd_factor) if self.active else None
        self.done = False

    def _now(self, completed_steps: int) -> bool:
        return self.active and not self.done and completed_steps == self.cfg.profile_step

    @contextlib.contextmanager
    def forward(self, completed_steps: int):
        if not self._now(completed_steps):
            yield
            return
        self.profiler.resume_profile()  # the step's micro-batches add up
        try:
            yield
        finally:
            self.profiler.stop_profile()

    def step_done(self, completed_before: int, record, batch_per_rank: int, sizes: dict):
        """Called at the boundary of the step that started with `completed_before` steps done."""
        if not self._now(completed_before):
            return None
        self.done = True
        ms = {name: record.values.get(TIMER_EVENT.format(name), 0.0) / 1000.0 for name in ("forward", "backward",
                                                                                             "step")}
        times = StepTimes(ms["forward"], ms["backward"], ms["step"], batch_per_rank, sizes["world"], sizes["data"],
                          sizes["model"])
        text = self.profiler.print_model_profile(profile_step=completed_before, module_depth=self.cfg.module_depth,
                                                 top_modules=self.cfg.top_modules, detailed=self.cfg.detailed,
                                                 output_file=self.cfg.output_file, step_times=times)
        self.profiler.end_profile()
        return text
