"""Token-choice top-k routing from router logits (pure tensor functions): DeepSpeed 0.19.8's
TokenChoiceTopKRouter arithmetic, which is also what each Hugging Face family's own router does.

    scores   = softmax(logits) or sigmoid(logits), in fp32
    choice   = scores (+ the model's e_score_correction_bias, DeepSeek-V3's noaux_tc)
    groups   = optional group-limited routing: experts in `num_expert_groups` groups, each
               scored by its top-2 sum (DeepSeek-V3) or its best expert (DeepSeek-V2); only
               the best `num_limited_groups` groups stay selectable
    experts  = the top-k of choice
    weights  = scores of those experts (not choice: the bias picks, it does not weigh),
               / their sum when route_norm, x route_scale
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass(frozen=True)
class RoutingRule:
    num_experts: int
    top_k: int
    score_func: str  # softmax | sigmoid
    route_norm: bool
    route_scale: float = 1.0
    num_expert_groups: Optional[int] = None
    num_limited_groups: Optional[int] = None
    group_score_func: str = "top2_sum"  # top2_sum | max


def route(logits: torch.Tensor, rule: RoutingRule,
          correction_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [tokens, experts] -> (weights [tokens, k] fp32, experts [tokens, k] int64)."""
    logits = logits.float()
    scores = torch.sigmoid(logits) if rule.score_func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float().unsqueeze(0)
    if rule.num_expert_groups is not None:
        choice = _limit_groups(choice, rule)
    chosen = torch.topk(choice, k=rule.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    if rule.route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * rule.route_scale, chosen


def _limit_groups(choice: torch.Tensor, rule: RoutingRule) -> torch.Tensor:
    per_group = rule.num_experts // rule.num_expert_groups
    grouped = choice.view(-1, rule.num_expert_groups, per_group)
    if rule.group_score_func == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.topk(group_scores, k=rule.num_limited_groups, dim=-1, sorted=False).indices
    masked = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
    return grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).view(-1, rule.num_experts)
