"""Mixture-of-Experts gating: which expert(s) each token goes to, where in the expert's
buffer it sits, with what weight, and the load-balancing loss. Pure tensor functions.

    r = top1_gating(logits, capacity_factor=1.0, min_capacity=4)
    r.indices[j, t]    route j of token t: its expert, or -1 when capacity dropped it
    r.locations[j, t]  its slot in that expert's buffer (0 where dropped)
    r.weights[j, t]    the weight its expert's output gets when combined (fp32)
    r.capacity         slots per expert (the buffer is [experts, capacity, hidden])
    r.l_aux            the auxiliary load-balancing loss
    r.exp_counts       tokens each expert was chosen by, before capacity dropped any

The formulas are DeepSpeed's (sharded_moe.py, after GShard and fairscale), so the same
logits and the same random stream give the same routing and the same loss:

    capacity   ceil(tokens / experts x capacity_factor x k), at least `min_capacity`, and
               never more than the token count (no expert can receive more tokens than
               there are; DeepSpeed sizes its buffer past that and once crashed on it)
    top-1 aux  experts x sum_e(mean gate_e x fraction routed to e)
    top-2 aux  experts^2 x mean_e(mean gate_e x fraction whose first choice is e)
    top-k aux  experts^2 / k x mean_e(mean gate_e x fraction routed to e)

`drop_tokens=False` sizes capacity to the busiest expert instead; that size must be the
same on every rank of the expert-parallel group (the all-to-all exchanges equal blocks),
so the caller passes `agree_max`, a function taking the local maximum (a 0-d tensor) to
the group's; None means one rank. It is the only way out of this module.

Randomness comes from torch's default generator, as DeepSpeed's does: random token
selection (RTS) ranks competing tokens by a uniform draw, 'RSample' adds Gumbel noise to
the top-1 choice, top-2 samples its second expert with Gumbel noise unless
`second_expert_sampling=False`, and 'Jitter' (gate input noise) is the layer's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

AgreeMax = Optional[Callable[[torch.Tensor], torch.Tensor]]
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routing:
    """The gating decision for `tokens` tokens over `num_experts` experts, k routes each."""

    l_aux: torch.Tensor
    capacity: int
    num_experts: int
    indices: torch.Tensor  # [k, tokens] int64, -1: dropped
    locations: torch.Tensor  # [k, tokens] int64
    weights: torch.Tensor  # [k, tokens] float32
    exp_counts: torch.Tensor  # [num_experts] int64

    def combine_weights(self) -> torch.Tensor:
        """The dense [tokens, experts, capacity] form (GShard's combine tensor): entry
        [t, e, c] is the weight of token t's output from slot c of expert e."""
        k, s = self.indices.shape
        out = torch.zeros(s, self.num_experts, self.capacity, dtype=self.weights.dtype, device=self.weights.device)
        kept = self.indices >= 0
        tok = torch.arange(s, device=self.indices.device).expand(k, s)
        out[tok[kept], self.indices[kept], self.locations[kept]] = self.weights[kept]
        return out

    def slots(self) -> torch.Tensor:
        """[k, tokens] flat index into the [experts x capacity + 1] buffer; dropped routes
        point at the extra last row (a scratch slot, always zero)."""
        flat = self.indices * self.capacity + self.locations
        return torch.where(self.indices >= 0, flat, torch.full_like(flat, self.num_experts * self.capacity))


def capacity(tokens: int, num_experts: int, capacity_factor: float, min_capacity: int, k: int = 1) -> int:
    """Slots per expert: ceil(tokens / experts x capacity_factor x k), at least
    `min_capacity`, at most `tokens`."""
    want = math.ceil(tokens / num_experts * (capacity_factor * k))
    return int(min(max(want, int(min_capacity)), tokens))


def _busiest(exp_counts: torch.Tensor, agree_max: AgreeMax) -> int:
    top = exp_counts.max().clone()
    if agree_max is not None:
        top = agree_max(top)
    return int(top)


def _aux_terms(gates: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    # mean gate probability x fraction of tokens routed, per expert
    return gates.mean(dim=0) * chosen.float().mean(dim=0)


def top1_gating(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4,
                used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
                drop_tokens: bool = True, use_rts: bool = True, agree_max: AgreeMax = None) -> Routing:
    """Each token to its most probable expert (Switch routing)."""
    tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    chooser = logits + torch.distributions.Gumbel(
        torch.tensor(0.0, device=logits.device), torch.tensor(1.0, device=logits.device)).rsample(logits.shape) \
        if noisy_gate_policy == "RSample" else gates
    first = chooser.argmax(dim=1)
    mask = F.one_hot(first, num_experts)
    if used_token is not None:
        mask = (mask * used_token.reshape(-1, 1)).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if drop_tokens:
        cap = capacity(tokens, num_experts, capacity_factor, min_capacity)
    else:
        cap = min(_busiest(exp_counts, agree_max), tokens)
    l_aux = _aux_terms(gates, mask).sum() * num_experts

    # Which tokens an over-full expert keeps: the highest-ranked `cap` of its column, ranked
    # by a uniform draw (RTS) or, without it, as torch.topk orders equal values.
    rank_by = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
    keep = torch.zeros_like(mask).scatter_(0, torch.topk(rank_by, k=cap, dim=0)[1], 1) if cap > 0 \
        else torch.zeros_like(mask)
    mask = mask * keep
    locations = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(dim=1)
    kept = mask.sum(dim=1) > 0
    weights = (gates * mask).sum(dim=1)
    indices = torch.where(kept, first, torch.full_like(first, -1))
    return Routing(l_aux, cap, num_experts, indices.unsqueeze(0), locations.unsqueeze(0), weights.unsqueeze(0),
                   exp_counts)


def top2_gating(logits: torch.Tensor, capacity_factor: float = 1.0, min_capacity: int = 4,
                drop_tokens: bool = True, second_expert_sampling: bool = True,
                agree_max: AgreeMax = None) -> Routing:
    """Each token to its two most probable experts (GShard), the second chosen with Gumbel
    noise unless `second_expert_sampling=False`; the two weights renormalised to sum to 1."""
    tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = gates.argmax(dim=1)
    mask1 = F.one_hot(first, num_experts)
    chooser = logits
    if second_expert_sampling:
        chooser = logits + torch.distributions.Gumbel(
            torch.tensor(0.0, device=logits.device), torch.tensor(1.0, device=logits.device)).rsample(logits.shape)
    second = chooser.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
    mask2 = F.one_hot(second, num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    # second choices queue behind every first choice of their expert
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = _aux_terms(gates, mask1).mean() * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        cap = capacity(tokens, num_experts, capacity_factor, min_capacity, k=2)
        mask1 = mask1 * (loc1 < cap)
        mask2 = mask2 * (loc2 < cap)
    else:
        cap = _busiest(exp_counts, agree_max)
    g1 = (gates * mask1).sum(dim=1)
    g2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    idx1 = torch.where(mask1.any(dim=1), first, torch.full_like(first, -1))
    idx2 = torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))
    return Routing(l_aux, cap, num_experts, torch.stack([idx1, idx2]),
                   torch.stack([(loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)]), torch.stack([g1, g2]),
                   exp_counts)


def topk_gating(logits: torch.Tensor, k: int, capacity_factor: float = 1.0, min_capacity: int = 4,
                drop_tokens: bool = True, agree_max: AgreeMax = None) -> Routing:
    """Each token to its k most probable experts; an over-full expert keeps the tokens that
    gave it the highest probability; weights renormalised over the kept routes."""
    tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = _aux_terms(gates, mask).mean() * num_experts * num_experts / k
    if drop_tokens:
        cap = capacity(tokens, num_experts, capacity_factor, min_capacity, k=k)
        by_prob = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        if cap > 0:
            keep_idx = torch.topk(by_prob, k=cap, dim=0, sorted=False)[1]
            mask &= torch.zeros_like(mask).scatter_(0, keep_idx, True)
        else:
            mask &= False
    else:
        cap = _busiest(exp_counts, agree_max)
    locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)
    indices = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    return Routing(l_aux, cap, num_experts, indices.t().contiguous(),
                   (locations.gather(1, top_idx) * kept).t().contiguous(), masked.gather(1, top_idx).t().contiguous(),
                   exp_counts)


def jitter(x: torch.Tensor, epsilon: float = 1e-2) -> torch.Tensor:
    """Multiply by noise uniform in [1 - epsilon, 1 + epsilon] (the 'Jitter' policy, on the
    gate's input, in training only)."""
    low = torch.tensor(1.0 - epsilon, device=x.device)
    high = torch.tensor(1.0 + epsilon, device=x.device)
    return x * torch.distributions.Uniform(low, high).rsample(x.shape)


def route(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, *,
          used_token: Optional[torch.Tensor] = None, noisy_gate_policy: Optional[str] = None,
          drop_tokens: bool = True, use_rts: bool = True, second_expert_sampling: bool = True,
          agree_max: AgreeMax = None) -> Routing:
    """The gating for `k` (1: top-1 with its options; 2: top-2; more: top-k). `used_token`
    and `noisy_gate_policy` apply to top-1 only, as in DeepSpeed."""
    if k == 1:
        return top1_gating(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens,
                           use_rts, agree_max)
    if k == 2:
        return top2_gating(logits, capacity_factor, min_capacity, drop_tokens, second_expert_sampling, agree_max)
    return topk_gating(logits, k, capacity_factor, min_capacity, drop_tokens, agree_max)
