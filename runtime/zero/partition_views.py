"""DeepSpeed's stage 1/2 optimizer attributes for the flat parameter buffers and how they split.

DeepSpeed's ZeRO-1/2 optimizer keeps each parameter group in one flat 16-bit buffer and lists
each rank's slice of it: `optimizer.parallel_partitioned_bit16_groups[group][rank]`. Slices
start at multiples of `optimizer.nccl_start_alignment_factor` elements (2: 4 bytes of fp16),
so every all-gather send buffer is 4-byte aligned; DeepSpeed's tests check the data pointers.

Here each group's flat buffer is in the model dtype (fp32, bf16 or fp16) and its partition
size is padded to a multiple of 2 x world (partition.py), so the same alignment holds. The
slices are read from the strategy's groups on every access: offload_states moves a buffer's
storage, and views taken earlier would keep pointing at the old one.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import List

import torch

ALIGNMENT_ELEMENTS = 2  # DeepSpeed's nccl_start_alignment_factor: 4 bytes / sizeof(fp16)


class _GroupViews(Sequence):
    """A list-like view that reads one value per strategy group on every access, never caching."""

    def __init__(self, groups):
        self._groups = groups  # the strategy's list of groups (flat buffer, layout, axis)

    def _view(self, group):
        raise NotImplementedError

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._view(self._groups[index])

    def __len__(self) -> int:
        return len(self._groups)


class PartitionedGroups(_GroupViews):
    """`optimizer.parallel_partitioned_bit16_groups`: per group, every rank's slice of its flat buffer."""

    def _view(self, group) -> List[torch.Tensor]:
        return list(group.flat.view(group.axis.size, group.layout.partition_size).unbind(0))


class FlatGroups(_GroupViews):
    """`optimizer.bit16_groups_flat`: per group, its whole flat buffer (the parameters are views
    into it), detached from autograd as DeepSpeed's is."""

    def _view(self, group) -> torch.Tensor:
        return group.flat


def publish_partitions(optimizer, groups) -> None:
    """Give the engine's optimizer DeepSpeed's stage 1/2 names for the flat buffers and their slices."""
    optimizer.nccl_start_alignment_factor = ALIGNMENT_ELEMENTS
    optimizer.bit16_groups_flat = FlatGroups(groups)
    optimizer.parallel_partitioned_bit16_groups = PartitionedGroups(groups)
