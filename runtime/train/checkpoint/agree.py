"""Every rank learns whether every other rank's part of a save or load succeeded.

A checkpoint step that fails on one rank (its disk is full, its shard is damaged) must
fail on all of them with the same one-line error: a rank that raised alone would leave
the others waiting in the next collective until the timeout. Each phase therefore ends
in `agree`, one all_gather_object over the group of every rank that takes part in the
checkpoint (the whole job: every rank writes or reads its own files).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist

from ...core import comm
from ...core.errors import CheckpointError


def checkpoint_group():
    """All ranks of the job: a checkpoint is written and read by every one of them."""
    return dist.group.WORLD


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agree(error: Optional[str], payload: Any = None, on_failure=None) -> List[Any]:
    """All ranks' payloads, in rank order, once every rank has reported; if any rank
    reported an error, `on_failure()` runs (rank 0 tidies up) and every rank raises the
    first error, prefixed with the rank it happened on."""
    if not _distributed():
        results = [(error, payload)]
    else:
        group = checkpoint_group()
        results = [None] * dist.get_world_size(group)
        comm.all_gather_object(results, (error, payload), group=group, label="checkpoint agree")
    failures = [(r, e) for r, (e, _) in enumerate(results) if e is not None]
    if failures:
        if on_failure is not None:
            on_failure()
        rank, err = failures[0]
        raise CheckpointError(err if len(results) == 1 else f"rank {rank}: {err}")
    return [p for _, p in results]


def barrier() -> None:
    if _distributed():
        comm.barrier(group=checkpoint_group(), label="checkpoint barrier")
