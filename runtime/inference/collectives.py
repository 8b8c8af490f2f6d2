"""The tensor-parallel collectives, each on the group it is given.

Every collective of the inference engine goes through these two functions so that the
group is always explicit (never the implicit world); they run on the runtime's comm layer
(flight record, watchdog, comms logger).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import comm


def all_reduce_sum_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum `tensor` in place over `group` (a row-parallel layer's partial products)."""
    comm.all_reduce(tensor, op=comm.ReduceOp.SUM, group=group, label="tp row-parallel sum")
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, group: Optional[dist.ProcessGroup], size: int) -> torch.Tensor:
    """Concatenate every rank's `tensor` along the last dimension, in rank order (vocab logits)."""
    tensor = tensor.contiguous()
    flat = tensor.reshape(1, -1)
    out = torch.empty((size, flat.shape[1]), dtype=tensor.dtype, device=tensor.device)
    comm.all_gather_into_tensor(out, flat, group=group, label="tp gather last dim")
    out = out.view((size,) + tuple(tensor.shape))
    return out.movedim(0, -2).reshape(*tensor.shape[:-1], size * tensor.shape[-1])
