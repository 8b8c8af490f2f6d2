"""The shard vocabulary between the strategies and the checkpoint writer.

A strategy describes how it holds the optimizer state (its `ShardLayout`) and hands it
over as a `ShardState`; checkpoint/ writes and re-cuts what it is given from these
values alone, never asking which strategy or ZeRO stage produced them. Loading goes the
other way: checkpoint/ reads what a checkpoint holds for this rank as `SavedShards`, and
the strategy's `load_shard_state` fits it to its own partition.

Three kinds of shard (DeepSpeed's file formats follow them, checkpoint/dsformat.py):

  WHOLE          every rank holds the whole state: torch's optimizer state_dict, plus
                 each group's parameter names and, under mixed precision, the fp32 masters
                 (data parallelism without ZeRO);
  FLAT           each param group's trainable parameters end to end, one contiguous
                 partition per data-parallel rank (ZeRO 1 and 2);
  PER_PARAMETER  every parameter cut on its own into one chunk per data-parallel rank
                 (ZeRO 3).

The two sharded kinds hand over the same name-keyed form (zero/reshard.py: pieces of each
parameter, its fp32 master and optimizer state), so any of them re-cuts into any other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional


class ShardKind(Enum):
    WHOLE = "whole"
    FLAT = "flat"
    PER_PARAMETER = "per_parameter"


class FrozenRecord(Enum):
    """How the model-states file records parameters that do not train (DeepSpeed's
    frozen_param_shapes / frozen_param_fragments)."""

    NONE = "none"          # not recorded (they are in the module state)
    WHOLE = "whole"        # shapes, and each whole tensor
    FRAGMENT = "fragment"  # shapes, and this rank's padded chunk of each


@dataclass(frozen=True)
class ShardLayout:
    """How one strategy holds its optimizer state, in the terms the checkpoint files need."""

    kind: ShardKind
    zero_stage: int  # the number DeepSpeed's files record for this layout (written and compared, never branched on)
    dp_size: int     # the data-parallel group the state is partitioned over
    dp_rank: int
    frozen: FrozenRecord = FrozenRecord.NONE
    module_in_shards: bool = False    # the parameters live in the shards: the module file keeps empty placeholders
    own_model_file: bool = False      # every rank writes its own model-states file (the module is partitioned)
    records_tied: bool = False        # the model-states file lists tied parameters (shared_params)
    expert_files: bool = True         # MoE experts are saved in DeepSpeed's per-expert files
    sub_group_size: int = 0           # PER_PARAMETER: DeepSpeed's sub-groups within a param group
    recuts: bool = False              # loads a checkpoint saved at another world size, stage or topology

    @property
    def sharded(self) -> bool:
        """One optimizer file per rank (otherwise the state sits in the model-states file)."""
        return self.kind is not ShardKind.WHOLE


@dataclass
class ShardState:
    """This rank's optimizer state as its strategy hands it to the checkpoint writer."""

    layout: ShardLayout
    state: Optional[Dict[str, Any]]  # WHOLE: {"optimizer", "param_names", ...}; sharded: the name-keyed shard
    param_groups: List[Dict[str, Any]] = field(default_factory=list)  # the live groups (hyperparameters)


@dataclass
class SavedShards:
    """What a checkpoint holds for this rank's optimizer: one whole state (kind WHOLE), or
    name-keyed shards (this rank's own, or every saved rank's to be re-cut)."""

    whole: Optional[Dict[str, Any]] = None
    shards: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def is_whole(self) -> bool:
        return self.whole is not None


__all__ = ["FrozenRecord", "SavedShards", "ShardKind", "ShardLayout", "ShardState"]
