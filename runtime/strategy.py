"""The seam between the engine and the ways of keeping gradients, optimizer state and weights.

The engine (engine.py) owns what every stage shares: the forward call, loss scaling for
fp16, gradient-accumulation counting, clipping arithmetic, the LR scheduler, logging and
checkpoint files. A `GradientStrategy` owns what differs between ZeRO stages: where
gradients are reduced to, where the fp32 master weights and optimizer state live, how the
module's parameters are refreshed after a step, and (stage 3) how parameters are gathered
around forward. `zero_optimization.stage` picks the strategy class from a registry:

    stage 0  dslaunch.runtime.data_parallel.DataParallelStrategy  (bucketed all-reduce)
    stage 1, 2  dslaunch.runtime.zero.stage12.ZeroStage1 / ZeroStage2
    stage 3  dslaunch.runtime.zero.stage3.ZeroStage3  (imported lazily on first use)

Every collective a strategy runs is on `ctx.group`, the data-parallel group (from the
engine's topology: the world without pipeline or mpu, the ranks holding the same
pipeline stage and tensor slice otherwise); `ctx.rank` and `ctx.world_size` are this
rank's place in that group and its size, and all shard arithmetic uses them.

A strategy registers itself with `@register_strategy(stage)`. Asking for a stage with no
registered strategy is a single ConfigError.

Call order, per optimizer step of `gas` micro-batches (engine view):

    for each micro-batch i (boundary = i == gas - 1):
        out = engine(batch)               # module forward (stage 3 gathers via wrap_module hooks)
        strategy.before_backward(boundary)
        (loss * loss_scale / gas).backward()
        strategy.after_backward(boundary) # boundary: reductions may still be in flight
    # at the boundary, inside engine.step():
    strategy.reduce_gradients()           # wait; averaged grads now where the optimizer reads them
    norm = strategy.global_grad_norm()    # only when clipping or fp16; over all ranks; inf/nan = overflow
    if overflow: strategy.zero_grad(); skip the step
    strategy.scale_gradients_(coef)       # one multiply: 1/loss_scale and the clip coefficient
    strategy.optimizer_step()             # update masters, write back / all-gather module params
    strategy.zero_grad()

Contract details:
- Communication off the boundary (`communicates_every_micro_step`): stages 0 and 1
  accumulate gradients locally and run no collective on a non-boundary micro-step.
  Stages 2 and 3 keep only a partition of the gradients, so, as in DeepSpeed, every
  micro-step's backward reduces its gradients to their owners (stage 3 also gathers
  parameters around every forward and backward); nothing else runs off the boundary.
- `ctx.optimizer`'s param_groups initially hold the module's own parameters. A strategy
  may replace each group's "params" with its own tensors (fp32 masters, flat shards); it
  must keep the group dicts themselves, because LR schedulers write "lr" into them.
- Gradients reported by `global_grad_norm` are still multiplied by the loss scale and
  already averaged over data-parallel ranks (and divided by `gas` through the loss). The
  norm covers this rank's model (every shard of it over ctx.group) minus the parameters
  in `ctx.norm_exclude` (copies whose gradient is counted on another rank, e.g. a weight
  tied across pipeline stages); the engine sums it over the model-parallel group.
- `sum_param_grads_(params, group)` (after reduce_gradients) adds the reduced gradients
  of `params` over another group: weights tied across pipeline stages.
- Checkpoints: `module_state_dict()` is called on every rank (it may be collective) and
  must return the full, unsharded module state on rank 0. `optimizer_state_dict()` returns
  this rank's optimizer state; with `sharded_optimizer_state = True` every rank's dict is
  saved to its own file, otherwise only rank 0's is saved. Loading calls
  `load_module_state_dict` then `load_optimizer_state_dict` on every rank, each with what
  was saved for that rank; masters must be refreshed from the loaded module weights. A
  strategy with `loads_any_world_size = True` is instead handed the list of every saved
  rank's ZeRO shard when the checkpoint's stage or world size differs from its own.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Optional, Type

import torch
import torch.distributed as dist

from .config import DeepSpeedConfig
from .strict import ConfigError


@dataclass
class StrategyContext:
    """Everything a strategy is built from; created by the engine once."""

    module: torch.nn.Module  # on `device`, parameters already cast to `compute_dtype`
    optimizer: torch.optim.Optimizer  # param_groups still reference the module's parameters
    config: DeepSpeedConfig
    device: torch.device
    compute_dtype: torch.dtype  # float32, float16 or bfloat16
    rank: int  # in the data-parallel group
    world_size: int  # of the data-parallel group
    group: Optional[Any] = None  # the data-parallel process group (None only when world_size is 1)
    norm_exclude: FrozenSet[int] = frozenset()  # id(param)s left out of global_grad_norm

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()


class GradientStrategy:
    """Base class; see the module docstring for the call order. Defaults suit strategies
    that keep full replicas of parameters (stages 0-2)."""

    stage: int = -1
    sharded_optimizer_state: bool = False
    communicates_every_micro_step: bool = False  # see "Communication off the boundary" above

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self.module = ctx.module
        self.optimizer = ctx.optimizer

    # -- forward / backward -------------------------------------------------------------
    def wrap_module(self) -> None:
        """Install forward hooks on `self.module` (stage 3: gather/release parameters)."""

    def before_backward(self, is_boundary: bool) -> None:
        """Called just before loss.backward(); tells hooks whether to communicate."""

    def after_backward(self, is_boundary: bool) -> None:
        """Called just after loss.backward()."""

    # -- boundary ------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        raise NotImplementedError

    def global_grad_norm(self) -> float:
        raise NotImplementedError

    def scale_gradients_(self, factor: float) -> None:
        raise NotImplementedError

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def sum_param_grads_(self, params, group) -> None:
        """Sum the reduced gradients of `params` (module parameters) over `group`."""
        raise NotImplementedError(f"{type(self).__name__} cannot sum gradients of tied parameters")

    # -- checkpoints ---------------------------------------------------------------------
    def module_state_dict(self) -> Dict[str, Any]:
        return self.module.state_dict()

    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_optimizer_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Remove hooks; the engine calls this when it is destroyed or replaced."""


_REGISTRY: Dict[int, Type[GradientStrategy]] = {}
# Modules imported on demand so that their @register_strategy decorators run.
_PROVIDERS = {0: "dslaunch.runtime.data_parallel", 1: "dslaunch.runtime.zero.stage12",
              2: "dslaunch.runtime.zero.stage12", 3: "dslaunch.runtime.zero.stage3"}


def register_strategy(stage: int) -> Callable[[Type[GradientStrategy]], Type[GradientStrategy]]:
    def deco(cls: Type[GradientStrategy]) -> Type[GradientStrategy]:
        cls.stage = stage
        _REGISTRY[stage] = cls
        return cls

    return deco


def strategy_for_stage(stage: int) -> Type[GradientStrategy]:
    if stage not in _REGISTRY and stage in _PROVIDERS:
        try:
            importlib.import_module(_PROVIDERS[stage])
        except ModuleNotFoundError as exc:
            if exc.name != _PROVIDERS[stage]:
                raise
    if stage not in _REGISTRY:
        raise ConfigError(f"zero_optimization.stage: stage {stage} is not available in this build "
                          f"(no strategy registered for it; available: {sorted(_REGISTRY) or [0]})")
    return _REGISTRY[stage]
