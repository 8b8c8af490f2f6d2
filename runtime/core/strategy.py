"""The seam between the engine and the ways of keeping gradients, optimizer state and weights.

The engine (engine.py) owns what every stage shares: the forward call, loss scaling for
fp16, gradient-accumulation counting, clipping arithmetic, the LR scheduler, logging and
checkpoint files. A `GradientStrategy` owns what differs between ZeRO stages: where
gradients are reduced to, where the fp32 master weights and optimizer state live, how the
module's parameters are refreshed after a step, and (stage 3) how parameters are gathered
around forward. `zero_optimization.stage` picks the strategy class from a registry:

    stage 0  dslaunch.runtime.zero.stage0.DataParallelStrategy  (bucketed all-reduce)
    stage 1, 2  dslaunch.runtime.zero.stage12.ZeroStage1 / ZeroStage2
    stage 3  dslaunch.runtime.zero.stage3.ZeroStage3

The strategies register themselves when dslaunch.runtime.zero is imported (the engine does);
nothing here names them.

Every collective a strategy runs is on `ctx.group`, the data-parallel group (from the
engine's topology: the world without pipeline or mpu, the ranks holding the same
pipeline stage and tensor slice otherwise); `ctx.rank` and `ctx.world_size` are this
rank's place in that group and its size, and all shard arithmetic uses them.

Except per optimizer param group: `ctx.axes[i]` (a `ReduceAxis`) is the axis whose group
param group i's gradients are averaged over and its state sharded over. It is decided
here, once, from the engine's mesh (`group_axis_name`): a group marked `"moe": True` (as
DeepSpeed's split_params_into_different_moe_groups_for_optimizer marks expert
parameters) uses the mesh's "expert_data" axis, every other group "data". A moe group's
gradients are summed over expert_data and divided by the data-parallel size
(`ReduceAxis.average_over`), DeepSpeed's averaging: the MoE layer's all-to-all already
brought each expert the tokens of its whole expert-parallel group. Without moe
groups every axis is the data axis itself and strategies behave as if it did not exist.
Stages 0-2 honour other axes; stage 3, optimizer offload (cpu, nvme) and checkpoints
(save and load, at any world size: rank 0's module state and name-keyed shard re-cutting
cannot tell experts apart) refuse them in one line.

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
  norm covers this rank's model (every shard of it over ctx.group, every expert of a
  "moe" group once) minus the parameters
  in `ctx.norm_exclude` (copies whose gradient is counted on another rank, e.g. a weight
  tied across pipeline stages); the engine sums it over the model-parallel group.
- `sum_param_grads_(params, group)` (after reduce_gradients) adds the reduced gradients
  of `params` over another group: weights tied across pipeline stages.
- Whole-parameter access (DeepSpeed's tensor-fragment API, zero/fragments.py): every
  strategy links the module's parameters to itself (`owner_of(param)`: a weak link that
  copies of the parameter do not carry) and answers `full_hp` / `set_full_hp` (the fp32
  master, or one optimizer state tensor, of one parameter, gathered from or scattered to
  the ranks holding its pieces), `full_grad` / `set_full_grad`, and, at stage 3 only,
  the `local_*` calls (this rank's chunk). They are collective over the parameter's
  group: every rank calls them for the same parameters in the same order. Gradients are
  readable in the window between the boundary micro-step's backward and step()
  (`open_grad_window` / `close_grad_window`, called by the engine); the first access
  reduces them then (`grads_for_access`), and step() does not reduce again
  (`reduce_gradients_once`).
- Checkpoints: `module_state_dict()` is called on every rank (it may be collective) and
  must return the full, unsharded module state on rank 0. `optimizer_state_dict()` returns
  this rank's optimizer state; with `sharded_optimizer_state = True` every rank's dict is
  saved to its own file, otherwise only rank 0's is saved. Loading calls
  `load_module_state_dict` then `load_optimizer_state_dict` on every rank, each with what
  was saved for that rank; masters must be refreshed from the loaded module weights. A
  strategy with `loads_any_world_size = True` is instead handed the list of every saved
  rank's ZeRO shard when the checkpoint's stage or world size differs from its own.
  The checkpoint writer sees none of this directly: it calls `shard_state()` (the state
  with its `shard_layout()`, core/shard_state.py) and `load_shard_state(SavedShards)`.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Type

import torch
import torch.distributed as dist

from .precision import PrecisionPolicy
from .shard_state import SavedShards, ShardLayout, ShardState
from .strict import ConfigError

if TYPE_CHECKING:  # the strategies read the parsed config the engine hands them; they never parse one
    from .config import DeepSpeedConfig


DATA_AXIS = "data"
EXPERT_DATA_AXIS = "expert_data"


@dataclass(frozen=True)
class ReduceAxis:
    """The mesh axis one optimizer param group's gradients are averaged over and its ZeRO
    state sharded over: its name, this rank's group on it, and this rank's place in it."""

    name: str
    group: Optional[Any]
    rank: int
    size: int
    divisor: Optional[int] = None  # what the sum over `group` is divided by; None: `size`

    @property
    def average_over(self) -> int:
        return self.size if self.divisor is None else self.divisor


def group_axis_name(param_group: Dict[str, Any]) -> str:
    """The mesh axis a param group reduces over: expert parameters (DeepSpeed's `"moe": True`
    groups) over their expert-data-parallel group, everything else over the data axis."""
    return EXPERT_DATA_AXIS if param_group.get("moe", False) else DATA_AXIS


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
    mesh: Optional[Any] = None  # the engine's ProcessMesh (or MpuMesh): where non-data axes come from
    loss_scale: Callable[[], float] = lambda: 1.0  # the engine's current fp16 loss scale (Muon unscales with it)
    # every dtype a strategy keeps (masters, gradient partitions, optimizer state): the engine's
    # policy; None (a strategy built outside an engine): the config's, with compute_dtype
    precision: Optional[PrecisionPolicy] = None
    axes: List[ReduceAxis] = field(init=False)  # one per optimizer param group (see the module docstring)

    def __post_init__(self):
        if self.precision is None:
            self.precision = PrecisionPolicy.from_config(self.config, compute=self.compute_dtype)
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        self.axes = [self.axis(group_axis_name(g)) for g in groups]

    @property
    def data_axis(self) -> ReduceAxis:
        return ReduceAxis(DATA_AXIS, self.group, self.rank, self.world_size)

    def axis(self, name: str) -> ReduceAxis:
        """The mesh axis `name` as a ReduceAxis ("data": the context's own group)."""
        if name == DATA_AXIS or self.mesh is None:
            return self.data_axis
        if not self.mesh.describes(name):  # an mpu object describes no experts: experts on the data axis
            return self.data_axis
        size = self.mesh.size(name)
        # Expert gradients are summed over their replicas and divided by the data-parallel
        # size, as DeepSpeed does: an expert already received every token of its expert-
        # parallel group through the all-to-all, so this is the average over all ranks and
        # the result does not depend on ep_size (it equals one process holding every expert).
        divisor = self.world_size if name == EXPERT_DATA_AXIS else None
        return ReduceAxis(name, self.mesh.group(name), self.mesh.rank(name), size, divisor)

    def expert_axis(self) -> Optional[ReduceAxis]:
        """The "expert" axis (ranks holding different experts), when the mesh has one over
        more than one rank: a norm over expert parameters sums their squares over it."""
        if self.mesh is None or not self.mesh.describes("expert"):
            return None
        size = self.mesh.size("expert")
        return ReduceAxis("expert", self.mesh.group("expert"), self.mesh.rank("expert"), size) if size > 1 else None

    def axis_for_params(self) -> Dict[int, ReduceAxis]:
        """id(param) -> its group's axis, for the optimizer's current param groups."""
        out: Dict[int, ReduceAxis] = {}
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        for g, axis in zip(groups, self.axes):
            for p in g["params"]:
                out.setdefault(id(p), axis)
        return out

    def foreign_axes(self) -> List[ReduceAxis]:
        """The param groups' axes that are not the data-parallel group itself."""
        out = []
        for a in self.axes:
            if a.name != DATA_AXIS and (a.group is not self.group or a.size != self.world_size) and a not in out:
                out.append(a)
        return out

    def refuse_foreign_axes(self, what: str, hint: str = "\"moe\" param groups need ZeRO stage 0, 1 or 2 "
                                                                 "without offload") -> None:
        """One ConfigError when a param group asks for an axis `what` cannot handle."""
        foreign = self.foreign_axes()
        if foreign:
            raise ConfigError(f"{what}: a param group reduces over the {foreign[0].name!r} axis "
                              f"({foreign[0].size} ranks, not the data-parallel group), which this "
                              f"cannot do: {hint}")

    def communicates(self, axis: ReduceAxis) -> bool:
        return axis.size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()


class FragmentError(ValueError):
    """A whole-parameter access that cannot be answered (outside the gradient window, an
    optimizer state key that does not exist, a local partition below stage 3, a value of
    the wrong size). A ValueError, as DeepSpeed raises for the first two."""


def check_numel(what: str, value: torch.Tensor, numel: int) -> torch.Tensor:
    """`value` flattened, refusing one of the wrong size."""
    if not torch.is_tensor(value):
        raise FragmentError(f"{what}: expected a tensor, got {type(value).__name__}")
    if value.numel() != numel:
        raise FragmentError(f"{what}: the value has {value.numel()} elements, the parameter {numel}")
    return value.detach().reshape(-1)


def state_tensor(state: Dict[str, Any], key: str, name: str) -> torch.Tensor:
    """Optimizer state `key` of one partition, refusing a key it does not hold."""
    v = state.get(key)
    if not torch.is_tensor(v) or key == "step":
        have = sorted(k for k, t in state.items() if torch.is_tensor(t) and k != "step")
        held = ", ".join(have) if have else "nothing yet: state exists from the first step on"
        raise FragmentError(f"optimizer state {key!r} not found for {name} (it holds {held})")
    return v


class StrategyLink:
    """What a parameter keeps of the strategy that owns it: a weak reference, so a parameter
    does not keep an engine alive, and one that a copy of the parameter does not carry
    (copy.deepcopy of a model, as TRL makes its reference model, or pickling it): a copy
    is owned by no engine."""

    __slots__ = ("_ref",)

    def __init__(self, strategy: Optional["GradientStrategy"]):
        self._ref = weakref.ref(strategy) if strategy is not None else None

    def __call__(self) -> Optional["GradientStrategy"]:
        return self._ref() if self._ref is not None else None

    def __deepcopy__(self, memo) -> "StrategyLink":
        return StrategyLink(None)

    def __reduce__(self):
        return (StrategyLink, (None,))


def owner_of(param) -> Optional["GradientStrategy"]:
    """The strategy that steps `param`, or None (no engine, or the engine is gone)."""
    link = getattr(param, "_dslaunch_strategy", None)
    return link() if isinstance(link, StrategyLink) else None


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
        self.link_params()

    # -- forward / backward -------------------------------------------------------------
    def wrap_module(self) -> None:
        """Install forward hooks on `self.module` (stage 3: gather/release parameters)."""

    def before_backward(self, is_boundary: bool) -> None:
        """Called just before loss.backward(); tells hooks whether to communicate."""

    def after_backward(self, is_boundary: bool) -> None:
        """Called just after loss.backward()."""

    # -- coalesced reduction (engine.coalesce_grad_reduction) ---------------------------
    def hold_reductions(self) -> None:
        """From now on a backward reduces nothing: each rank sums its own gradients (stage 3:
        in a full-size buffer per parameter, as DeepSpeed holds them in param.grad) until
        release_held_reductions. ZeRO stages 1-3 only; the engine refuses the others."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold its gradient reductions")

    def release_held_reductions(self, reduce: bool) -> None:
        """End the hold. reduce: one reduction pass over everything summed since
        hold_reductions, as a boundary backward's would be. Otherwise (the block raised) the
        gradients stay where the next reduction (a backward's or the step's) finds them, so
        nothing is lost; every rank must then end the hold the same way."""
        raise NotImplementedError(f"{type(self).__name__} cannot hold its gradient reductions")

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

    # -- the gradient window (see "Whole-parameter access" above) ---------------------------
    _grad_window = False  # the boundary backward ran and step() has not consumed its gradients
    _reduced_early = False  # a fragment access reduced them inside the window
    # inside engine.no_sync(): safe_get_full_grad answers as DeepSpeed's does there, with the
    # gradient as it stands (this rank's unreduced sum in the model dtype; nothing is reduced)
    local_grads_readable = False

    def open_grad_window(self) -> None:
        self._grad_window = True

    def close_grad_window(self) -> None:
        self._grad_window = self._reduced_early = False

    @property
    def grad_window_open(self) -> bool:
        """The boundary's backward ran and no step has consumed its gradients yet."""
        return self._grad_window

    @property
    def grads_reduced_early(self) -> bool:
        return self._reduced_early

    def reduce_gradients_once(self) -> None:
        """The engine's reduction at step(): skipped when an access already did it."""
        if not self._reduced_early:
            self.reduce_gradients()

    def grads_for_access(self, what: str) -> None:
        """Before a gradient is read or written by parameter: refuse outside the window, and
        reduce (once, collectively) inside it, so the value is the averaged gradient the
        optimizer will step with."""
        if not self._grad_window:
            raise FragmentError(f"{what}: gradients are only available between engine.backward() on the "
                                f"gradient-accumulation boundary and engine.step()")
        if not self._reduced_early:
            self.reduce_gradients()
            self._reduced_early = True

    def complete_reductions(self, what: str) -> None:
        """DeepSpeed's engine.allreduce_gradients(): the boundary's gradients reduced now, where
        the step reads them (once: the step does not reduce again, and a further backward before
        it is refused). ZeRO-3, whose backwards reduce as they go, overrides it."""
        self.grads_for_access(what)

    # -- whole-parameter access (zero/fragments.py); defaults for no trainable parameter --------
    def link_params(self) -> None:
        """Point every module parameter at this strategy, so fragments.py finds its owner."""
        link = StrategyLink(self)
        for p in self.module.parameters():
            p._dslaunch_strategy = link

    def full_hp(self, param, key: Optional[str] = None) -> Optional[torch.Tensor]:
        """The whole fp32 master of `param` (key None) or its optimizer state `key`; None
        when the optimizer does not hold the parameter (frozen)."""
        return None

    def set_full_hp(self, param, value: torch.Tensor, key: Optional[str] = None) -> None:
        """Write a whole value into the master (and the module's copy) or the state `key`."""

    def full_grad(self, param) -> Optional[torch.Tensor]:
        return None

    def set_full_grad(self, param, value: torch.Tensor) -> None:
        pass

    def local_hp(self, param, key: Optional[str] = None) -> Optional[torch.Tensor]:
        raise FragmentError(self._no_local("safe_get_local_*"))

    def set_local_hp(self, param, value: torch.Tensor, key: Optional[str] = None) -> None:
        raise FragmentError(self._no_local("safe_set_local_*"))

    def local_grad(self, param) -> Optional[torch.Tensor]:
        raise FragmentError(self._no_local("safe_get_local_grad"))

    def set_local_grad(self, param, value: torch.Tensor) -> None:
        raise FragmentError(self._no_local("safe_set_local_grad"))

    def _no_local(self, what: str) -> str:
        return (f"{what}: local partitions are defined for ZeRO stage 3 parameters only (as in DeepSpeed); "
                f"this engine runs stage {self.stage}: use the safe_*_full_* calls")

    # -- checkpoints ---------------------------------------------------------------------
    def module_state_dict(self) -> Dict[str, Any]:
        return self.module.state_dict()

    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_optimizer_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])

    # -- the checkpoint contract (core/shard_state.py) --------------------------------------
    def shard_layout(self) -> ShardLayout:
        """How this strategy holds its optimizer state, as the checkpoint files describe it."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its shard layout")

    def shard_state(self) -> ShardState:
        """This rank's optimizer state for the checkpoint writer (collective where
        optimizer_state_dict is)."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return ShardState(self.shard_layout(), self.optimizer_state_dict(), groups)

    def load_shard_state(self, saved: SavedShards) -> None:
        """What a checkpoint holds for this rank, fitted to this strategy's partition."""
        self.load_optimizer_state_dict(saved.whole if saved.is_whole else saved.shards)

    def empty_partition_cache(self) -> None:
        """Leave every split parameter at rest (engine.empty_partition_cache). Only stage 3
        splits parameters; the other strategies keep them whole, so there is nothing to free."""

    def close(self) -> None:
        """Remove hooks; the engine calls this when it is destroyed or replaced."""


# Filled by @register_strategy as the strategies are imported (dslaunch.runtime.zero registers
# stages 0-3; the engine imports it). This module names none of them: core stands below them.
_REGISTRY: Dict[int, Type[GradientStrategy]] = {}


def register_strategy(stage: int) -> Callable[[Type[GradientStrategy]], Type[GradientStrategy]]:
    def deco(cls: Type[GradientStrategy]) -> Type[GradientStrategy]:
        cls.stage = stage
        _REGISTRY[stage] = cls
        return cls

    return deco


def strategy_for_stage(stage: int) -> Type[GradientStrategy]:
    if stage not in _REGISTRY:
        raise ConfigError(f"zero_optimization.stage: stage {stage} is not available in this build "
                          f"(no strategy registered for it; available: {sorted(_REGISTRY) or [0]})")
    return _REGISTRY[stage]
