"""Weight-only int8 with per-group scales (symmetric), and its dequantisation.

A weight [rows, cols] is cut along its input dimension into groups of `group` columns; each
group of each row keeps one scale = max|w| / 127 and int8 values round(w / scale). Groups
are laid out in the unsharded weight's coordinates and never straddle a shard boundary; when
the group divides the shard width (the default 64 on real widths, or a q_groups that does),
a tensor-parallel rank quantises exactly the groups the single-process model would.

The matmul reads these through int8_kernel.py: our C++ kernel (int8_linear.cpp) for decode
shapes with fp32 activations on the CPU, which widens each int8 weight in registers; otherwise
`dequantize_int8` below, a torch op (int8 -> compute dtype, times the broadcast scales), makes
the local shard's dense weight for torch's matmul. scripts/bench_inference.py times both.

Error bound: per element |w - q*s| <= s/2 = max|w_group| / 254, i.e. at most 0.4% of the
group's largest weight.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

DEFAULT_GROUP = 64


def group_size_for(full_in: int, local_in: int, q_groups: Optional[int], extra_grouping: bool = False) -> int:
    """Columns per scale for a weight with `full_in` inputs of which a shard holds `local_in`.

    q_groups (DeepSpeed's count of groups per row of the unsharded weight) sets the group to
    full_in / q_groups (doubled groups for MLP layers with mlp_extra_grouping); without it a
    group is 64 columns. Either way the group is cut down to divide the shard's width.
    """
    if q_groups:
        groups = q_groups * (2 if extra_grouping else 1)
        group = full_in // groups if full_in % groups == 0 else full_in
    else:
        group = DEFAULT_GROUP
    return math.gcd(group, local_in)


def quantize_int8(weight: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 values [rows, cols], scales [rows, cols // group] in float32)."""
    rows, cols = weight.shape
    w = weight.detach().float().reshape(rows, cols // group, group)
    scale = w.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(rows, cols), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = q.shape
    groups = scale.shape[-1]
    w = q.reshape(rows, groups, cols // groups).to(dtype) * scale.to(dtype).unsqueeze(-1)
    return w.reshape(rows, cols)
