"""DeepSpeed's activation checkpointing API, as `deepspeed.checkpointing`:

    deepspeed.checkpointing.configure(mpu, deepspeed_config="ds_config.json")
    y = deepspeed.checkpointing.checkpoint(block, x, mask)   # block's activations are recomputed in backward

`checkpoint` is reentrant, like DeepSpeed's: the segment runs without grad in forward, only
its inputs are kept (partitioned, moved to the CPU or packed as configured, saved.py), and
backward re-runs it with grad from the same RNG states (rng.py), so dropout draws the same
numbers, then back-propagates through it. As with DeepSpeed's, at least one input must
require grad for the segment's parameters to get gradients. `initialize()` applies a
config's `activation_checkpointing` section here unless configure() was already called.
"""
from __future__ import annotations

import contextlib
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...core.config import DeepSpeedConfig
from ...core.strict import ConfigError
from . import rng, saved
from .rng import (CudaRNGStatesTracker, get_cuda_rng_tracker, model_parallel_cuda_manual_seed,
                  model_parallel_reconfigure_tp_seed)


@dataclass
class Settings:
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    configured: bool = False
    by_engine: bool = False  # applied by initialize(), which a later engine may redo; configure() by the script is kept
    mpu: Any = None
    mp_group: Any = None
    mp_size: int = 1
    mp_rank: int = 0
    slots: Optional[saved.ContiguousSlots] = None


state = Settings()


def _mp_from(mpu):
    if mpu is None:
        return None, 1, 0
    if hasattr(mpu, "get_tensor_model_parallel_rank"):
        return (mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_world_size(),
                mpu.get_tensor_model_parallel_rank())
    return mpu.get_model_parallel_group(), mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None, *,
              _by_engine: bool = False) -> None:
    """Set up checkpointing from a DeepSpeed config (dict, path or parsed) and/or the
    keyword overrides; `mpu_` supplies the model-parallel group for partition_activations."""
    global state
    new = Settings(mpu=mpu_ if mpu_ is not None else state.mpu)
    if deepspeed_config is not None:
        section = DeepSpeedConfig.load(deepspeed_config).activation_checkpointing
        new.partition_activations = section.partition_activations
        new.contiguous_memory_optimization = section.contiguous_memory_optimization
        new.number_checkpoints = section.number_checkpoints
        new.cpu_checkpointing = section.cpu_checkpointing
        new.synchronize_checkpoint_boundary = section.synchronize_checkpoint_boundary
        new.profile = section.profile
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_memory_optimization", contiguous_checkpointing),
                        ("number_checkpoints", num_checkpoints), ("cpu_checkpointing", checkpoint_in_cpu),
                        ("synchronize_checkpoint_boundary", synchronize), ("profile", profile)):
        if value is not None:
            setattr(new, name, value)
    if new.contiguous_memory_optimization:
        if not new.partition_activations:
            raise ConfigError("activation_checkpointing.contiguous_memory_optimization: needs partition_activations "
                              "(it packs the partitioned activations)")
        if not new.number_checkpoints:
            raise ConfigError("activation_checkpointing.number_checkpoints: required with "
                              "contiguous_memory_optimization")
        new.slots = saved.ContiguousSlots(int(new.number_checkpoints))
    new.mp_group, new.mp_size, new.mp_rank = _mp_from(new.mpu)
    new.configured = True
    new.by_engine = _by_engine
    state = new


def configure_from_engine(mpu, config) -> None:
    """initialize(): apply the engine's section unless the script called configure() itself."""
    if not state.configured or state.by_engine:
        configure(mpu, deepspeed_config=config, _by_engine=True)


def is_configured() -> bool:
    return state.configured


def reset() -> None:
    """Free the contiguous buffers (call after forwards that had no backward, e.g. eval)."""
    if state.slots is not None:
        state.slots.clear()


def set_num_layers(nlayers: int) -> None:
    state.number_checkpoints = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    state.partition_activations = bool(partition_activation)


def _sync() -> None:
    if state.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()


def _say(name: str, phase: str, seconds: float) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"activation checkpoint {name}: {phase} {seconds * 1000:.2f} ms", file=sys.stdout, flush=True)


# Set by an autotuning trial's probe (runtime/train/autotuning.py): told the inputs each segment
# keeps (observer.kept(tensors)) and wrapped around each recompute (observer.recompute()),
# so the profile step measures what checkpointing saves. None outside a trial.
observer: Any = None


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, outputs_holder, *args):
        _sync()
        start = time.perf_counter()
        ctx.run_function = run_function
        ctx.rng = rng.snapshot()
        tensors, ctx.others = saved.split_tensors(args)
        ctx.needs_grad = [t is not None and t.requires_grad for t in tensors]
        if observer is not None:
            observer.kept(tensors)
        ctx.kept = saved.keep(tensors, state, state.slots)
        ctx.slots = state.slots
        with torch.no_grad():
            outputs = run_function(*args)
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        ctx.single = single
        ctx.mark_non_differentiable(*[o for o in outputs if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        outputs_holder.append(single)
        _sync()
        if state.profile:
            _say(getattr(run_function, "__name__", type(run_function).__name__), "forward", time.perf_counter() - start)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        _sync()
        start = time.perf_counter()
        inputs = saved.restore(ctx.kept, ctx.needs_grad, state)
        # the kept inputs are done with: a script that holds its output (and so this node)
        # past backward must not hold them too, as save_for_backward's tensors are not held
        ctx.kept = None
        if ctx.slots is not None:
            ctx.slots.closed()
        args = saved.merge(inputs, ctx.others)
        now = rng.snapshot()
        rng.restore(ctx.rng)
        try:
            with torch.enable_grad(), (observer.recompute() if observer is not None else contextlib.nullcontext()):
                outputs = ctx.run_function(*args)
        finally:
            rng.restore(now)
        outputs = (outputs,) if ctx.single else outputs
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _sync()
        if state.profile:
            name = getattr(ctx.run_function, "__name__", type(ctx.run_function).__name__)
            _say(name, "recompute+backward", time.perf_counter() - start)
        return (None, None) + tuple(t.grad if t is not None and t.requires_grad else None for t in inputs)


_warned_no_grad = False


def checkpoint(function, *args, **kwargs):
    """Run `function(*args, **kwargs)` keeping only its inputs; recompute it in backward."""
    global _warned_no_grad
    if kwargs:
        keys, n_pos, inner = tuple(kwargs), len(args), function

        def function(*all_args):
            return inner(*all_args[:n_pos], **dict(zip(keys, all_args[n_pos:])))

        args = args + tuple(kwargs.values())
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        if not _warned_no_grad:
            warnings.warn("deepspeed.checkpointing.checkpoint: no input requires grad, so the checkpointed "
                          "segment's parameters get no gradient (as with DeepSpeed's reentrant checkpoint)",
                          stacklevel=2)
            _warned_no_grad = True
    holder: list = []
    outputs = CheckpointFunction.apply(function, holder, *args)
    return outputs[0] if holder and holder[0] else outputs


class _RngReplay:
    """torch's non-reentrant checkpoint's contexts: the forward one records the generators as
    the segment starts (the CPU's, the device's and the model-parallel tracker's named states),
    the recompute one runs the segment again from them, then puts back the states it found."""

    def __init__(self):
        self.at_forward = None

    @contextlib.contextmanager
    def forward(self):
        self.at_forward = rng.snapshot()
        yield

    @contextlib.contextmanager
    def recompute(self):
        now = rng.snapshot()
        rng.restore(self.at_forward)
        try:
            yield
        finally:
            rng.restore(now)


def non_reentrant_checkpoint(function, *args, **kwargs):
    """DeepSpeed's non-reentrant checkpoint: the segment runs with grad, its saved activations
    are dropped and recomputed when backward first needs them (torch's saved-tensor hooks), so
    its parameters get gradients even when no input requires grad, and outputs may be any
    mix of tensors and other values. The recompute draws the same random numbers (tracker
    included). Keeping inputs partitioned, on the CPU or in contiguous buffers is done by
    `checkpoint` only: under those settings this refuses rather than ignore them."""
    if state.partition_activations or state.cpu_checkpointing or state.contiguous_memory_optimization:
        on = [k for k in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
              if getattr(state, k)]
        raise ConfigError(f"activation_checkpointing: {', '.join(on)} applies to deepspeed.checkpointing.checkpoint "
                          "(reentrant) only; non_reentrant_checkpoint keeps its inputs as they are: turn "
                          f"{'it' if len(on) == 1 else 'them'} off or use checkpoint")
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    replay = _RngReplay()
    return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False,
                            context_fn=lambda: (replay.forward(), replay.recompute()), **kwargs)


__all__ = ["configure", "checkpoint", "non_reentrant_checkpoint", "is_configured", "reset", "set_num_layers",
           "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker",
           "CheckpointFunction", "partition_activations_in_checkpoint"]
