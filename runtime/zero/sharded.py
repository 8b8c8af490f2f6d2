"""What ZeRO stages 1-3 share as engine strategies (see dslaunch.runtime.strategy for the
call order): the data-parallel group they shard over, and checkpoints of one optimizer
shard per rank.

The checkpoint contract (core/shard_state.py): `shard_state()` hands over this rank's
shard (pieces of fp32 masters and optimizer state, keyed by parameter name) with the
subclass's `shard_layout()`; the checkpoint writer saves one file per rank.
`load_shard_state` accepts this rank's own shard, every saved rank's shards (another world
size or stage), or a whole stage-0 state, and re-cuts them to this rank's partition, so any
saved world size and stage loads directly. `optimizer_state_dict` /
`load_optimizer_state_dict` are the same state as plain values.
"""
from __future__ import annotations

from typing import Any, Dict, List, Union

from ..core.strategy import GradientStrategy, StrategyContext
from ..core import comm
from ..core.shard_state import SavedShards
from .reshard import shards_from_stage0


def _as_shards(state, group_names, module_state) -> List[Dict[str, Any]]:
    """Shards from what the engine read: this rank's shard, every saved rank's shards, or
    a stage-0 checkpoint's torch optimizer state (resuming stage 0 under ZeRO)."""
    if isinstance(state, list):
        return state
    if isinstance(state, dict) and "groups" in state:
        return [state]
    return shards_from_stage0(state, group_names, module_state or {})


def offload_optimizer(ctx: StrategyContext):
    off = getattr(ctx.config.zero_optimization, "offload_optimizer", None)
    return off if off is not None and off.device != "none" else None


class ShardedStrategy(GradientStrategy):
    """Base of ZeroStage1/2/3. Subclasses provide `partition_state()` / `load_shards(shards)`
    (their pieces of masters and optimizer state) and `listed_names` (each optimizer
    group's parameter names, for re-cutting a stage-0 checkpoint)."""

    sharded_optimizer_state = True
    loads_any_world_size = True  # the engine then hands load_optimizer_state_dict every saved shard
    _module_state = None  # kept so a stage-0 optimizer state can be re-cut with these weights

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        self.group = ctx.group
        self.world, self.rank = ctx.world_size, ctx.rank
        size, rank = comm.get_world_size(self.group), comm.get_rank(self.group)
        if ctx.distributed and (size, rank) != (self.world, self.rank):
            raise ValueError(f"ZeRO: the data-parallel group has {size} ranks (this one is "
                             f"{rank}) but the engine says {self.world} (rank {self.rank})")
        self.listed_names: List[List[str]] = []

    def optimizer_state_dict(self) -> Dict[str, Any]:
        state = self.partition_state()
        # The groups' hyperparameters (lr, betas, weight_decay, ...), as torch's state_dict keeps
        # them: a scheduler the engine does not own (the HF Trainer's LambdaLR) restores only its
        # own counters, and the lr it set last must come back with the optimizer.
        groups = self.optimizer.param_groups if self.optimizer is not None else []  # none: a forward-only engine
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        return state

    def load_optimizer_state_dict(self, state: Union[Dict[str, Any], List[Dict[str, Any]]]) -> None:
        self._load_all(_as_shards(state, self.listed_names, self._module_state))

    def load_shard_state(self, saved: SavedShards) -> None:
        self._load_all(shards_from_stage0(saved.whole, self.listed_names, self._module_state or {})
                       if saved.is_whole else saved.shards)

    def _load_all(self, shards: List[Dict[str, Any]]) -> None:
        self.load_shards(shards)
        saved = shards[0].get("param_groups") if shards else None
        if saved is not None and self.optimizer is not None and len(saved) == len(self.optimizer.param_groups):
            for group, hyper in zip(self.optimizer.param_groups, saved):
                group.update(hyper)

    def _excluded_names(self) -> set:
        return {n for n, p in self.module.named_parameters() if id(p) in self.ctx.norm_exclude}

    def partition_state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_shards(self, shards: List[Dict[str, Any]], load_optimizer: bool = True) -> None:
        raise NotImplementedError

