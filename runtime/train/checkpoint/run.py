"""What checkpoint/ sees of a training run: `Run`, built by the engine for each
save_checkpoint / load_checkpoint call (engine._checkpoint_run).

Plain values (this rank's coordinates, counters, the config it runs) and the objects that own
state: the module, the strategy (its module state and its optimizer state through the shard
contract, core/shard_state.py), the loss scaler and the LR scheduler. checkpoint/ never sees
the engine itself, so it cannot reach past these into the engine's internals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from ...core.strategy import GradientStrategy
from .layout import slice_rank


@dataclass(frozen=True)
class Placement:
    """This rank's coordinates, as the file names need them."""

    global_rank: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    mp_rank: int
    mp_size: int

    @property
    def slice(self) -> int:
        return slice_rank(self.pp_rank, self.mp_rank, self.mp_size)

    @property
    def slices(self) -> int:
        return self.pp_size * self.mp_size

    def topology(self) -> Dict[str, int]:
        return {"pipe": self.pp_size, "data": self.dp_size, "model": self.mp_size}


@dataclass
class Run:
    """One training run as a checkpoint call needs it (values as of the call)."""

    module: torch.nn.Module
    strategy: GradientStrategy
    place: Placement
    local_rank: int
    world_size: int
    config: Any                      # the run's DeepSpeedConfig (read only)
    compute_dtype: torch.dtype
    loss_scaler: Optional[Any]
    lr_scheduler: Optional[Any]
    global_steps: int
    skipped_steps: int
    global_samples: int
    counters: Dict[str, int]         # every counter a resume restores (engine.counters_state())
    accumulation: int                # gradient accumulation steps now
    restore_counters: Callable[[Dict[str, int]], None]
    expert_parallel_size: int = 1
    expert_rank: int = 0             # this rank on the expert axis (0 without expert parallelism)
    expert_data_rank: int = 0        # on the expert-data axis (the data axis without expert parallelism)
    expert_data_size: int = 1

    @property
    def global_rank(self) -> int:
        return self.place.global_rank


__all__ = ["Placement", "Run"]
