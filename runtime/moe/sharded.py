"""DeepSpeed's gating functions as `deepspeed.moe.sharded_moe` calls them: top1gating,
top2gating, topkgating with DeepSpeed 0.19.8's arguments and return values, and the sparse
dispatch helpers (_route_slots, _sparse_encode, _sparse_decode).

dslaunch's MoE layer routes through gating.py (a Routing record, capacity capped at the token
count); this module gives scripts and tests that call DeepSpeed's functions directly the
answers DeepSpeed gives:

- dense form (default): (l_aux, combine_weights [s, e, c], dispatch_mask [s, e, c] bool,
  exp_counts [e]);
- `sparse_routes=True`: (l_aux, capacity, num_experts, indices [k, s] int32 (-1: dropped),
  locations [k, s] int32, gates [k, s], exp_counts);
- capacity: ceil(s / e x capacity_factor x k), at least min_capacity. The buffer keeps that
  width even when it exceeds the token count (only the selection of kept tokens is bounded
  by it), as DeepSpeed 0.19.8 does;
- `drop_tokens=False`: the capacity is the busiest expert's count, the maximum over
  `ep_group` when that group has more than one rank (an all_reduce MAX on it), rounded up to
  a multiple of the tensor-parallel degree (the non-expert layers' duplicate tokens are
  dropped per tensor rank); top1gating also caps it at the token count;
- topkgating's `drop_policy`: 'probs' keeps an over-full expert's most probable tokens,
  'position' its first ones; anything else is a ValueError.

One difference, on purpose: top2gating's second-expert sampling adds its Gumbel noise to a
copy of the logits; DeepSpeed adds it to the caller's tensor in place.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import comm
from ..core.parallel import groups

# DeepSpeed's sharded_moe holds deepspeed.comm as `dist`, and scripts patch its collectives there
# (the same module object as `comm`, so a patch reaches the calls below)
dist = comm

# DeepSpeed's flag for the Tutel kernels: dslaunch has none (MoE(use_tutel=True) is refused in one line)
TUTEL_INSTALLED = False

_DENSE = Tuple[Tensor, Tensor, Tensor, Tensor]
_SPARSE = Tuple[Tensor, Any, int, Tensor, Tensor, Tensor, Tensor]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over `group` (DeepSpeed's signature: apply(group, input)); its gradient
    is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, group, input: Tensor) -> Tensor:  # noqa: A002 - DeepSpeed's name
        ctx.group = group
        input = input.contiguous()
        out = torch.empty_like(input)
        comm.all_to_all_single(out, input, group=group, label="moe all-to-all")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        return None, _AllToAll.apply(ctx.group, grad)


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """ceil(tokens / experts x capacity_factor), at least min_capacity (an int64 0-d tensor)."""
    tokens, experts = gates.shape
    want = torch.ceil((tokens / experts) * capacity_factor).to(torch.int64)
    return torch.maximum(want, min_capacity.to(torch.int64))


def _is_parallel(group) -> bool:
    return group is not None and comm.get_world_size(group=group) > 1


def _no_drop_capacity(exp_counts: Tensor, ep_group) -> Tensor:
    """The busiest expert's count, agreed over ep_group, padded to the tensor-parallel degree."""
    top = torch.max(exp_counts)
    if _is_parallel(ep_group):
        comm.all_reduce(top, op=comm.ReduceOp.MAX, group=ep_group)
    tp = groups._get_model_parallel_world_size()
    if tp > 1:
        top = (torch.ceil(top / tp) * tp).to(top.dtype)
    return top


def _selection(capacity: Tensor, tokens: int) -> int:
    # torch.topk over the token dimension cannot pick more rows than there are tokens
    return int(min(int(capacity), tokens))


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """Each route's flat slot in the [experts x capacity] buffer; a dropped route (index < 0)
    goes to the extra slot num_experts x capacity."""
    flat = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, flat, torch.full_like(flat, num_experts * capacity))


def _sparse_encode(reshaped_input: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """[tokens, d] -> the [experts, capacity, d] buffer: each slot holds the token routed to it
    (zero where none is)."""
    tokens, d = reshaped_input.shape
    # which token fills each slot (`tokens`, a zero row, where none does)
    source = torch.full((num_experts * capacity + 1,), tokens, dtype=torch.long, device=slots.device)
    source.scatter_(0, slots.reshape(-1), torch.arange(tokens, device=slots.device).expand_as(slots).reshape(-1))
    padded = torch.cat([reshaped_input, reshaped_input.new_zeros(1, d)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d)


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """[experts x capacity, d] outputs -> [tokens, d]: each token's routes weighted by their
    gates and summed (in the gates' fp32), cast back to the outputs' dtype."""
    d = expert_output.size(-1)
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.size(0), num_tokens, d)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


def _gumbel(shape, device) -> Tensor:
    return torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                             torch.tensor(1.0, device=device)).rsample(shape)


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Optional[Tensor] = None,
               noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: Union[Any, None] = None, sparse_routes: bool = False,
               use_tutel: bool = False) -> Union[_DENSE, _SPARSE]:
    """Each token to its most probable expert (with Gumbel noise under 'RSample'); an
    over-full expert keeps `capacity` of its tokens, picked at random (RTS) or by position."""
    if use_tutel:
        raise ValueError("top1gating: use_tutel=True is not supported (dslaunch has no Tutel kernels)")
    noisy = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    tokens, num_experts = gates.shape
    capacity = _capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))
    first = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(first, num_classes=num_experts)
    if used_token is not None:
        mask = (used_token.unsqueeze(1) * mask).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach().to(logits.device)
    if not drop_tokens:
        capacity = torch.minimum(_no_drop_capacity(exp_counts, ep_group), torch.tensor(tokens))
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    rank_by = mask * torch.distributions.uniform.Uniform(
        torch.tensor(0.0, device=logits.device), torch.tensor(1.0, device=logits.device)).rsample(mask.shape) \
        if use_rts else mask
    if tokens < min_capacity:
        raise ValueError(f"top1gating: {tokens} tokens are fewer than min_capacity {min_capacity}; set "
                         "min_capacity to 0 or give a larger batch")
    keep = torch.topk(rank_by, k=_selection(capacity, tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    locations = torch.cumsum(mask, dim=0) - 1
    locations_s = (locations * mask).sum(dim=1)
    if sparse_routes:
        kept = mask.sum(dim=1) > 0
        indices = torch.where(kept, first, torch.full_like(first, -1))
        return (l_aux, capacity, num_experts, indices.to(torch.int32).unsqueeze(0),
                locations_s.to(torch.int32).unsqueeze(0), (gates * mask).sum(dim=1).unsqueeze(0), exp_counts)
    combine = (gates * mask.float()).unsqueeze(-1) * F.one_hot(locations_s, num_classes=int(capacity)).float() \
        .unsqueeze(1)
    return l_aux, combine, combine.bool(), exp_counts


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Union[Any, None] = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> Union[_DENSE, _SPARSE]:
    """Each token to its two most probable experts (the second sampled with Gumbel noise unless
    top2_2nd_expert_sampling=False), second choices queued behind every first choice; the two
    gates renormalised to sum to 1."""
    gates = F.softmax(logits, dim=1)
    tokens, num_experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    chooser = logits + _gumbel(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    second = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach().to(logits.device)
    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 = mask1 * torch.lt(loc1, capacity)
        mask2 = mask2 * torch.lt(loc2, capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)
    loc1_s, loc2_s = (loc1 * mask1).sum(dim=1), (loc2 * mask2).sum(dim=1)
    g1, g2 = (gates * mask1.float()).sum(dim=1), (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    if sparse_routes:
        idx1 = torch.where(mask1.any(dim=1), first, torch.full_like(first, -1))
        idx2 = torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))
        return (l_aux, capacity, num_experts, torch.stack([idx1, idx2]).to(torch.int32),
                torch.stack([loc1_s, loc2_s]).to(torch.int32), torch.stack([g1, g2]), exp_counts)
    c = int(capacity)
    combine = (g1.unsqueeze(1) * mask1.float()).unsqueeze(-1) * F.one_hot(loc1_s, num_classes=c).float().unsqueeze(1) \
        + (g2.unsqueeze(1) * mask2.float()).unsqueeze(-1) * F.one_hot(loc2_s, num_classes=c).float().unsqueeze(1)
    return l_aux, combine, combine.bool(), exp_counts


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: Union[Any, None] = None, drop_policy: str = "probs",
               sparse_routes: bool = False) -> Union[_DENSE, _SPARSE]:
    """Each token to its k most probable experts; an over-full expert keeps its most probable
    tokens ('probs') or its first ones ('position'); gates renormalised over the kept routes."""
    gates = F.softmax(logits, dim=1)
    tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach().to(logits.device)
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        if drop_policy == "probs":
            by_prob = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep = torch.topk(by_prob, k=_selection(capacity, tokens), dim=0, sorted=False)[1]
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, keep, True)
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask *= torch.lt(locations, capacity)
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy}")
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    if sparse_routes:
        kept = mask.gather(1, top_idx)
        indices = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
        return (l_aux, capacity, num_experts, indices.t().contiguous().to(torch.int32),
                (locations.gather(1, top_idx) * kept).t().contiguous().to(torch.int32),
                masked.gather(1, top_idx).t().contiguous(), exp_counts)
    combine = masked.unsqueeze(-1) * F.one_hot(locations * mask, num_classes=int(capacity)).float()
    return l_aux, combine, combine.bool(), exp_counts
