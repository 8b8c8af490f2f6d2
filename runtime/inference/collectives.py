"""The tensor-parallel collectives, each on the group it is given.

Every collective of the inference engine goes through these two functions so that the
group is always explicit (never the implicit world) and one place switches them over to
the runtime's comm layer.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def all_reduce_sum_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum `tensor` in place over `group` (a row-parallel layer's partial products)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], size: int) -> torch.Tensor:
    """Concatenate every rank's `tensor` along the last dimension, in rank order (vocab logits)."""
    tensor = tensor.contiguous()
    flat = tensor.reshape(1, -1)
    out = torch.empty((size, flat.shape[1]), dtype=tensor.dtype, device=tensor.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, flat, group=group)
    out = out.view((size,) + tuple(tensor.shape))
    return out.movedim(0, -2).reshape(*tensor.shape[:-1], size * tensor.shape[-1])
