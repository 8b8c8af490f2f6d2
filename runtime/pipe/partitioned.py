"""`PartitionedTensor`: one tensor split evenly over a process group, each rank keeping its
slice, rebuilt whole by an all-gather (DeepSpeed's helper that Megatron-DeepSpeed uses to pass
partitioned activations between pipeline stages).

The metadata (`to_meta`) is DeepSpeed's layout, a LongTensor: [ndim, *shape, num_parts,
rank, *boundaries], so a peer rebuilds the object from it and its local slice (`from_meta`).
"""
from __future__ import annotations

from typing import List

import torch

from ..core import comm


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """num_parts + 1 boundaries cutting num_items as evenly as possible, the larger parts
    first (with fewer items than parts, the first num_items parts hold one each)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    bounds = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            bounds[j] += 1
    return bounds


def prefix_sum_inc(weights) -> list:
    """The inclusive running totals of `weights` ([3, 4, 5] -> [3, 7, 12]), as a new list."""
    totals = []
    for w in weights:
        totals.append(w if not totals else totals[-1] + w)
    return totals


class PartitionedTensor:
    def __init__(self, tensor: torch.Tensor, group, partition_meta=None):
        self.group = group
        self.num_parts = comm.get_world_size(group=group)
        self.rank = comm.get_rank(group=group)
        self.orig_size = list(tensor.size())
        self.orig_device = tensor.device
        self.partition = partition_uniform(tensor.numel(), self.num_parts)
        flat = tensor.detach().contiguous().view(-1)
        self.local_data = flat[self.partition[self.rank]:self.partition[self.rank + 1]].clone()

    @classmethod
    def from_meta(cls, meta: torch.Tensor, local_part: torch.Tensor, group, device=None) -> "PartitionedTensor":
        values = [int(v) for v in meta.tolist()]
        ndim = values[0]
        obj = cls.__new__(cls)
        obj.group = group
        obj.orig_size = values[1:1 + ndim]
        obj.num_parts, obj.rank = values[1 + ndim], values[2 + ndim]
        obj.partition = values[3 + ndim:]
        if len(obj.partition) != obj.num_parts + 1 or obj.num_parts != comm.get_world_size(group=group):
            raise ValueError(f"PartitionedTensor.from_meta: metadata for {obj.num_parts} parts does not fit a group "
                             f"of {comm.get_world_size(group=group)}")
        obj.orig_device = device if device is not None else local_part.device
        obj.local_data = local_part
        return obj

    def to_meta(self) -> torch.Tensor:
        return torch.tensor([len(self.orig_size), *self.orig_size, self.num_parts, self.rank, *self.partition],
                            dtype=torch.long)

    def data(self) -> torch.Tensor:
        return self.local_data

    def local_size(self) -> torch.Size:
        return self.local_data.size()

    def full(self, device=None) -> torch.Tensor:
        """The whole tensor, gathered from every rank's slice (on `device`, else where it was)."""
        sizes = [self.partition[p + 1] - self.partition[p] for p in range(self.num_parts)]
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=self.local_data.dtype, device=self.local_data.device)
        padded[:self.local_data.numel()] = self.local_data.view(-1)
        parts = [torch.empty_like(padded) for _ in range(self.num_parts)]
        comm.all_gather(parts, padded, group=self.group, label="PartitionedTensor.full")
        flat = torch.cat([part[:n] for part, n in zip(parts, sizes)])
        return flat.view(self.orig_size).to(device if device is not None else self.orig_device)
