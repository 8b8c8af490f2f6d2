"""The experts one rank holds: `num_local` copies of the given module.

Every parameter is marked as DeepSpeed marks expert parameters (`allreduce = False`,
`group_name = "ep_size_<N>"`), which is what `utils.is_moe_param` and
`split_params_into_different_moe_groups_for_optimizer` read: their gradients are reduced
over the expert-data-parallel group, not the data-parallel one.
"""
from __future__ import annotations

import copy
from typing import List

import torch
from torch import nn


class Experts(nn.Module):
    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str = "ep_size_1"):
        super().__init__()
        # the attribute name is DeepSpeed's: checkpoints and state dicts keep its keys
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce = False
                p.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """`inputs` is [ranks, num_local_experts, capacity, hidden]: local expert i runs on
        slice [:, i] (its tokens from every rank of the expert-parallel group)."""
        outs: List[torch.Tensor] = []
        for chunk, e in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts):
            out = e(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: the output
        return torch.cat(outs, dim=1)
