"""Profilers: DeepSpeed's flops profiler on torch's flop counter (flops_profiler.py), its
text report (report.py) and the engine's per-step hook (step.py)."""
from .flops_profiler import FlopsProfiler, get_model_profile

__all__ = ["FlopsProfiler", "get_model_profile"]
