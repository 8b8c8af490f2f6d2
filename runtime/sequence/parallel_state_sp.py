"""A sequence-parallel `mpu`: DeepSpeed's `deepspeed.runtime.sequence_parallel.parallel_state_sp`.

Scripts written for Megatron-DeepSpeed call `initialize_sequence_parallel(n)` once and pass
this module as `initialize(..., mpu=...)`. The world is cut into consecutive blocks of `n`
ranks (one sequence group each); the sequence-data group is every rank, since sequence x data
covers the world; the data-parallel group (ranks at the same place of every block) is dslaunch's
addition, which the engine's mesh reads. The model-parallel getters answer for the sequence group, because sequence
parallelism is the only dimension this mpu adds beside data parallelism (as in DeepSpeed).

The groups are module state, as in DeepSpeed: `release()` forgets them (after the world's
process group was destroyed) so a later `initialize_sequence_parallel` can build new ones.
"""
from __future__ import annotations

from typing import List, Optional

from ..core import comm


class _State:
    sequence = None       # this rank's sequence-parallel group
    sequence_data = None  # this rank's sequence x data group (the world)
    data = None           # this rank's data-parallel group: the same place in every sequence block


def sequence_blocks(world_size: int, sequence_parallel_size: int) -> List[List[int]]:
    """The ranks of each sequence group: consecutive blocks of `sequence_parallel_size`
    (the sizes were checked by the caller)."""
    return [list(range(start, start + sequence_parallel_size))
            for start in range(0, world_size, sequence_parallel_size)]


def _check_sizes(world_size: int, sequence_parallel_size: int) -> None:
    # DeepSpeed's exceptions and their types, so a script catching them keeps working
    if world_size < sequence_parallel_size:
        raise RuntimeError(f"world_size ({world_size}) is less than sequence_parallel_size {sequence_parallel_size}")
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    if world_size % sequence_parallel_size != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by sequence_parallel_size "
                           f"{sequence_parallel_size}")


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build this rank's sequence group and sequence-data group (every rank calls it: each
    new_group is collective over the world)."""
    if not comm.is_initialized():
        raise RuntimeError("initialize_sequence_parallel: the process group is not initialized "
                           "(call deepspeed.init_distributed() first)")
    world_size = comm.get_world_size()
    _check_sizes(world_size, sequence_parallel_size)
    if _State.sequence is not None:
        raise RuntimeError("initialize_sequence_parallel: the sequence parallel groups are already initialized")
    rank = comm.get_rank()
    for ranks in sequence_blocks(world_size, sequence_parallel_size):
        group = comm.new_group(ranks, name="sequence " + ",".join(map(str, ranks)))
        if rank in ranks:
            _State.sequence = group
    for place in range(sequence_parallel_size):
        ranks = list(range(place, world_size, sequence_parallel_size))
        group = comm.new_group(ranks, name="data " + ",".join(map(str, ranks)))
        if rank in ranks:
            _State.data = group
    # data x sequence is the whole world: one group of every rank
    _State.sequence_data = comm.new_group(list(range(world_size)), name="sequence-data")


def release() -> None:
    """Forget the groups (DeepSpeed's `_release_sequence_parallel_groups`)."""
    _State.sequence = None
    _State.sequence_data = None
    _State.data = None


def _get(group: Optional[object], what: str):
    if group is None:
        raise RuntimeError(f"{what} group is not initialized (call initialize_sequence_parallel first)")
    return group


def get_sequence_parallel_group():
    return _get(_State.sequence, "sequence parallel")


def get_sequence_data_parallel_group():
    return _get(_State.sequence_data, "sequence data parallel")


def get_sequence_parallel_world_size() -> int:
    return comm.get_world_size(group=get_sequence_parallel_group())


def get_sequence_data_parallel_world_size() -> int:
    return comm.get_world_size(group=get_sequence_data_parallel_group())


def get_sequence_parallel_rank() -> int:
    return comm.get_rank(group=get_sequence_parallel_group())


def get_sequence_data_parallel_rank() -> int:
    return comm.get_rank(group=get_sequence_data_parallel_group())


def get_data_parallel_group():
    """Not in DeepSpeed's module (its engine takes the world as the data group for this mpu):
    the engine's mesh here asks an mpu for its data-parallel group."""
    return _get(_State.data, "data parallel")


def get_data_parallel_world_size() -> int:
    return comm.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return comm.get_rank(group=get_data_parallel_group())


# the only dimension beside data parallelism is the sequence one: model parallel is it
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
_release_sequence_parallel_groups = release  # DeepSpeed's private name
