"""The tensor-parallel group a model is sharded over: a view of a process mesh's tensor axis.

DeepSpeed's rank order puts tensor ranks next to each other: with tp ranks per group the
groups are [0..tp-1], [tp..2tp-1], ..., one full copy of the model per group (the other
axes, data and pipeline, go across groups). `tensor_parallel_group(tp_size)` builds that
layout as a ProcessMesh over the world (core/parallel: the one place groups are laid out and
made; every rank must call it, group creation is collective) and remembers the mesh's tensor
axis, so later callers (`tp_model_init`, `model_parallel_cuda_manual_seed`) find the same
group; `use_group(group)` installs one made elsewhere (the engine's mesh, a caller's group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..core import comm
from ..core.parallel import MeshDims, ProcessMesh, topology_for
from .shard import TensorParallelError


@dataclass(frozen=True)
class TensorParallelGroup:
    group: Any  # a ProcessGroup; None when size == 1 (no collective is ever needed)
    size: int
    rank: int  # this process's rank within the group
    ranks: Tuple[int, ...]  # the group's global ranks, in group-rank order


_current: Optional[TensorParallelGroup] = None


def tensor_parallel_group(tp_size: int, group: Any = None) -> TensorParallelGroup:
    """This rank's tensor-parallel group of `tp_size` ranks: `group` when given (its size must
    be tp_size), else the groups of tp_size adjacent ranks over the world, built on first use.
    The result becomes the current group (`current_group()`)."""
    global _current
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise TensorParallelError(f"tensor parallel: tp size must be a positive integer, got {tp_size!r}")
    if group is not None:
        return use_group(group, tp_size)
    if _current is not None and _current.size == tp_size:
        return _current
    if tp_size == 1:
        _current = TensorParallelGroup(None, 1, 0, (comm.get_rank() if comm.is_initialized() else 0,))
        return _current
    if not comm.is_initialized():
        raise TensorParallelError(f"tensor parallel: tp size {tp_size} needs torch.distributed initialised "
                                  "(deepspeed.init_distributed() or a launcher)")
    world = comm.get_world_size()
    if world % tp_size:
        raise TensorParallelError(f"tensor parallel: tp size {tp_size} does not divide the world size {world}")
    mesh = ProcessMesh(topology_for(MeshDims.for_world(world, tensor=tp_size)))
    _current = TensorParallelGroup(mesh.group("tensor"), tp_size, mesh.rank("tensor"), tuple(mesh.ranks("tensor")))
    return _current


def use_group(group: Any, tp_size: Optional[int] = None) -> TensorParallelGroup:
    """Make `group` (a ProcessGroup this rank belongs to) the current tensor-parallel group."""
    global _current
    if not comm.is_initialized():
        raise TensorParallelError("tensor parallel: a group was given but torch.distributed is not initialised")
    size = comm.get_world_size(group)
    if tp_size is not None and size != tp_size:
        raise TensorParallelError(f"tensor parallel: tp size {tp_size} but the group given has {size} ranks")
    rank = comm.get_rank(group)
    if rank < 0:
        raise TensorParallelError("tensor parallel: this rank is not a member of the group given")
    _current = TensorParallelGroup(group if size > 1 else None, size, rank,
                                   tuple(comm.get_all_ranks_from_group(group)))
    return _current


def current_group() -> Optional[TensorParallelGroup]:
    """The group last built or installed here, or None."""
    return _current


def reset() -> None:
    """Forget the current group (tests; a process that tears torch.distributed down)."""
    global _current
    _current = None
