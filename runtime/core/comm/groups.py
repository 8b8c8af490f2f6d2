"""Process groups: queries that work with or without torch.distributed, the groups the
runtime creates (tracked so that shutdown can destroy them), and their names in records.

`group=None` means the default group, as in torch.distributed; the runtime always names
the group it means (tests/runtime/core/test_comm_api.py checks that every call site passes `group=`).
Without an initialised torch.distributed every group is this one process: rank 0 of 1.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from . import shm, shm_p2p, shutdown

_names: Dict[int, str] = {}  # id(group) -> name for records (the group itself is not kept alive here)


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_group():
    """The default group (torch's group.WORLD); None before init."""
    return dist.group.WORLD if is_initialized() else None


def get_rank(group=None) -> int:
    """This process's rank in `group` (-1 if it is not a member); 0 without torch.distributed."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_global_rank(group, group_rank: int) -> int:
    """The global rank of `group`'s rank `group_rank`."""
    if group is None or not is_initialized() or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> List[int]:
    if not is_initialized():
        return [0]
    return list(dist.get_process_group_ranks(group or dist.group.WORLD))


def group_name(group) -> str:
    """'world', the name given to new_group, or 'ranks 0,2'."""
    if group is None or not is_initialized() or group is dist.group.WORLD:
        return "world"
    name = _names.get(id(group))
    if name is None:
        name = "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
        _names[id(group)] = name
    return name


def new_group(ranks: Optional[Sequence[int]] = None, timeout=None, backend=None, name: Optional[str] = None,
              use_local_synchronization: bool = False, **kwargs):
    """torch.distributed.new_group (collective over the default group, unless
    use_local_synchronization), with a name for flight records and logs; the runtime
    destroys the group at exit. Without torch.distributed there is nothing to create."""
    if not is_initialized():
        return None
    if timeout is None:
        from .watchdog import backend_timeout, timeout_s

        timeout = backend_timeout(timeout_s())
    g = dist.new_group(ranks=list(ranks) if ranks is not None else None, timeout=timeout, backend=backend,
                       use_local_synchronization=use_local_synchronization, **kwargs)
    if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
        shutdown.track_group(g)
        if name:
            _names[id(g)] = name
    return g


def destroy_process_group(group=None) -> None:
    """torch.distributed.destroy_process_group; with no group (the default one) every group
    goes, and the watchdog stops first."""
    if not is_initialized():
        return
    if group is None or group is dist.group.WORLD:
        from . import watchdog

        watchdog.stop()
        _names.clear()
        shm.forget_all()
        shm_p2p.forget_all()
        dist.destroy_process_group()
        return
    shutdown.forget_group(group)
    shm.forget(group)
    _names.pop(id(group), None)
    dist.destroy_process_group(group)
