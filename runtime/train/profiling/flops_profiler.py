"""DeepSpeed's flops profiler, counting with torch's own flop counter.

    prof = FlopsProfiler(model)
    prof.start_profile(); model(x); prof.stop_profile()
    prof.print_model_profile(module_depth=-1, top_modules=1, detailed=True)
    flops, macs, params = get_model_profile(model, input_shape=(8, 3, 224, 224))

FLOPs per module come from `torch.utils.flop_counter.FlopCounterMode` (which knows the
matmul/conv/attention ops and attributes them to the module hierarchy); MACs are FLOPs/2
(torch counts a multiply-add as 2). Ops the counter does not model (elementwise,
normalisation) count 0, where DeepSpeed's hand-written formulas count roughly one FLOP per
element. Latency per module is the wall time between forward pre- and post-hooks
(synchronised on CUDA). The engine profiles the step `flops_profiler.profile_step`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode

from .report import print_model_profile, to_string


@dataclass
class ModuleStats:
    name: str  # "" for the root
    kind: str
    depth: int
    params: int
    flops: int = 0
    latency: float = 0.0  # seconds, summed over calls while profiling
    calls: int = 0
    children: List["ModuleStats"] = field(default_factory=list)

    @property
    def macs(self) -> int:
        return self.flops // 2


_warm = False


def _warm_counter() -> None:
    # The counter's first use in a process costs seconds of one-time set-up; pay it outside
    # the measured forward so module latencies stay true.
    global _warm
    if not _warm:
        with FlopCounterMode(display=False, depth=None):
            torch.ones(2, 2) @ torch.ones(2, 2)
        _warm = True


def _numel(p: torch.Tensor) -> int:
    z = getattr(p, "_zero", None)  # a ZeRO-3 partitioned parameter: its full size
    return z.numel if z is not None else p.numel()


class FlopsProfiler:
    def __init__(self, model: torch.nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._counter: Optional[FlopCounterMode] = None
        self._hooks: list = []
        self._starts: Dict[int, List[float]] = {}
        self._latency: Dict[int, float] = {}
        self._calls: Dict[int, int] = {}
        self._flops: Dict[str, int] = {}

    # -- DeepSpeed's surface -------------------------------------------------------------
    def start_profile(self, ignore_list=None) -> None:
        self.reset_profile()
        self.resume_profile(ignore_list)

    def resume_profile(self, ignore_list=None) -> None:
        """Count again, adding to the numbers so far (the engine's micro-batches of one step)."""
        _warm_counter()
        ignore = tuple(ignore_list or ())
        cuda = torch.cuda.is_available()

        def pre(module, args):
            if cuda:
                torch.cuda.synchronize()
            self._starts.setdefault(id(module), []).append(time.perf_counter())

        def post(module, args, out):
            if cuda:
                torch.cuda.synchronize()
            began = self._starts[id(module)].pop()
            self._latency[id(module)] = self._latency.get(id(module), 0.0) + time.perf_counter() - began
            self._calls[id(module)] = self._calls.get(id(module), 0) + 1

        for m in self.model.modules():
            if ignore and isinstance(m, ignore):
                continue
            self._hooks.append(m.register_forward_pre_hook(pre))
            self._hooks.append(m.register_forward_hook(post))
        self._counter = FlopCounterMode(display=False, depth=None)
        self._counter.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay until reset_profile/end_profile."""
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            for key, ops in self._counter.get_flop_counts().items():
                self._flops[key] = self._flops.get(key, 0) + int(sum(ops.values()))
            self._counter = None
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.started = False

    def reset_profile(self) -> None:
        self._starts, self._latency, self._calls, self._flops = {}, {}, {}, {}

    def end_profile(self) -> None:
        self.stop_profile()
        self.reset_profile()

    def get_total_flops(self, as_string: bool = False):
        return to_string(self.tree().flops, "FLOPS") if as_string else self.tree().flops

    def get_total_macs(self, as_string: bool = False):
        return to_string(self.tree().macs, "MACs") if as_string else self.tree().macs

    def get_total_duration(self, as_string: bool = False):
        return to_string(self.tree().latency, "s") if as_string else self.tree().latency

    def get_total_params(self, as_string: bool = False):
        return to_string(self.tree().params, "") if as_string else self.tree().params

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: Optional[str] = None, step_times=None) -> str:
        """Print (or write to output_file) the profile; returns the text."""
        return print_model_profile(self, profile_step, module_depth, top_modules, detailed, output_file, step_times)

    # -- the numbers, as a tree ---------------------------------------------------------
    def tree(self) -> ModuleStats:
        root_key = type(self.model).__name__

        def build(module, name, depth):
            key = root_key + ("." + name if name else "")
            stats = ModuleStats(name=name, kind=type(module).__name__, depth=depth,
                                params=sum(_numel(p) for p in module.parameters()),
                                flops=self._flops.get(key, 0), latency=self._latency.get(id(module), 0.0),
                                calls=self._calls.get(id(module), 0))
            for child_name, child in module.named_children():
                stats.children.append(build(child, f"{name}.{child_name}" if name else child_name, depth + 1))
            return stats

        return build(self.model, "", 0)


def get_model_profile(model: torch.nn.Module, input_shape=None, args=None, kwargs=None, print_profile: bool = True,
                      detailed: bool = True, module_depth: int = -1, top_modules: int = 1, warm_up: int = 1,
                      as_string: bool = True, output_file: Optional[str] = None, ignore_modules=None,
                      mode: str = "forward"):
    """DeepSpeed's get_model_profile: (flops, macs, params) of one forward (or generate)
    call after `warm_up` calls, printed as a profile unless print_profile is false."""
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError("get_model_profile: input_shape must be a non-empty tuple")
        first = next(model.parameters(), None)
        args = [torch.ones(input_shape, dtype=first.dtype if first is not None else torch.float32,
                           device=first.device if first is not None else "cpu")]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, args or kwargs")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    call = model.generate if mode == "generate" else model
    model.eval()
    with torch.no_grad():
        for _ in range(warm_up):
            call(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        call(*args, **kwargs)
        prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return to_string(flops, ""), to_string(macs, "MACs"), to_string(params, "")
    return flops, macs, params
