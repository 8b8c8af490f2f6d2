"""ZeRO stages as engine strategies (see dslaunch.runtime.strategy for the call order).

The checkpoint contract: `optimizer_state_dict()` returns this rank's shard (pieces of
fp32 masters and optimizer state, keyed by parameter name); the engine saves one file
per rank. `load_optimizer_state_dict` accepts this rank's own shard or, when the saved
world size differs, the list of every saved rank's shard, and re-cuts them to this
rank's partition, so any saved world size and stage loads directly.
"""
from __future__ import annotations

from typing import Any, Dict, List, Union

import torch

from ..strategy import GradientStrategy, StrategyContext, register_strategy
from .stage12 import PartitionedOptimizer


def _as_shards(state, group_names, module_state) -> List[Dict[str, Any]]:
    """Shards from what the engine read: this rank's shard, every saved rank's shards, or
    a stage-0 checkpoint's torch optimizer state (resuming stage 0 under ZeRO)."""
    from ..checkpoint.reshard import shards_from_stage0

    if isinstance(state, list):
        return state
    if isinstance(state, dict) and "groups" in state:
        return [state]
    return shards_from_stage0(state, group_names, module_state or {})


def _offload(ctx: StrategyContext):
    z = ctx.config.zero_optimization
    off = getattr(z, "offload_optimizer", None)
    return off if off is not None and off.device != "none" else None


class _ShardedStrategy(GradientStrategy):
    """What stages 1-3 share: every call is forwarded to the stage's implementation
    (`self.impl`), and checkpoints hold one optimizer shard per rank that load at any
    saved world size or stage."""

    sharded_optimizer_state = True
    loads_any_world_size = True  # the engine then hands load_optimizer_state_dict every saved shard
    _module_state = None  # kept so a stage-0 optimizer state can be re-cut with these weights

    def after_backward(self, is_boundary: bool) -> None:
        self.impl.after_backward(is_boundary)

    def reduce_gradients(self) -> None:
        self.impl.reduce_gradients()

    def global_grad_norm(self) -> float:
        return self.impl.global_grad_norm()

    def scale_gradients_(self, factor: float) -> None:
        self.impl.scale_gradients_(factor)

    def optimizer_step(self) -> None:
        self.impl.optimizer_step()

    def zero_grad(self) -> None:
        self.impl.zero_grad()

    def optimizer_state_dict(self) -> Dict[str, Any]:
        state = self.impl.shard_state()
        # The groups' hyperparameters (lr, betas, weight_decay, ...), as torch's state_dict keeps
        # them: a scheduler the engine does not own (the HF Trainer's LambdaLR) restores only its
        # own counters, and the lr it set last must come back with the optimizer.
        groups = self.optimizer.param_groups if self.optimizer is not None else []  # none: a forward-only engine
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        return state

    def load_optimizer_state_dict(self, state: Union[Dict[str, Any], List[Dict[str, Any]]]) -> None:
        shards = _as_shards(state, self.impl.listed_names, self._module_state)
        self.impl.load_shards(shards)
        saved = shards[0].get("param_groups") if shards else None
        if saved is not None and self.optimizer is not None and len(saved) == len(self.optimizer.param_groups):
            for group, hyper in zip(self.optimizer.param_groups, saved):
                group.update(hyper)

    def close(self) -> None:
        self.impl.close()


class _Stage12(_ShardedStrategy):
    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        z = ctx.config.zero_optimization
        self.impl = PartitionedOptimizer(ctx.module, ctx.optimizer, self.stage, z.reduce_bucket_size,
                                         z.allgather_bucket_size, overlap_comm=z.overlap_comm,
                                         offload=_offload(ctx), group=ctx.group, sub_group_size=z.sub_group_size)

    def before_backward(self, is_boundary: bool) -> None:
        self.impl.before_backward(is_boundary)

    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        self._module_state = state
        # the module's params are views into flat buffers: copy in place to keep them so
        with torch.no_grad():
            self.module.load_state_dict(state, strict=strict)
        for g in self.impl.groups:
            lo, hi = g.layout.partition_range(self.impl.rank)
            g.master.copy_(g.flat[lo:hi].float())


@register_strategy(1)
class ZeroStage1(_Stage12):
    """Optimizer state partitioned; full gradients until the boundary reduce-scatter."""


@register_strategy(2)
class ZeroStage2(_Stage12):
    """Optimizer state and gradients partitioned; gradients reduced during backward."""


@register_strategy(3)
class ZeroStage3(_ShardedStrategy):
    """Parameters partitioned at rest, gathered around each module's forward/backward."""

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        from .stage3 import Stage3Engine

        z = ctx.config.zero_optimization
        off_param = getattr(z, "offload_param", None)  # cpu: shards rest in host memory; nvme: in files
        self.impl = Stage3Engine(ctx.module, ctx.optimizer, z.stage3_param_persistence_threshold,
                                 z.stage3_prefetch_bucket_size, offload=_offload(ctx),
                                 offload_param=off_param if off_param is not None and off_param.device != "none" else None,
                                 group=ctx.group, sub_group_size=z.sub_group_size,
                                 reduce_bucket_size=z.reduce_bucket_size, check=z.sanity_checks(),
                                 max_live_parameters=z.stage3_max_live_parameters,
                                 max_reuse_distance=z.stage3_max_reuse_distance)

    def wrap_module(self) -> None:
        self.impl.wrap()

    def module_state_dict(self) -> Dict[str, Any]:
        return self.impl.full_state_dict()

    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        self._module_state = state
        self.impl.load_full_state_dict(state, strict=strict)
