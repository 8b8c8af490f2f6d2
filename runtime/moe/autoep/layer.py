"""AutoEPMoELayer: what takes a Hugging Face MoE block's place.

It keeps the block's router module (so the model's own router-logit recording, and with it the
load-balancing loss, works unchanged, and the router weight keeps its Hugging Face name) and its
shared expert, and replaces the experts with this rank's share of them (experts.py). Forward,
for hidden states [batch, seq, H]:

    logits     the router module's output (its first output when it returns several)
    routing    routing.route(): k experts and k weights per token (fp32)
    sort       the token copies (token x k) ordered by global expert
    dispatch   all-to-all over the expert group (dispatch.py): each rank gets the copies for
               its local experts from every rank of the group
    experts    w2 @ act(w1 @ x, w3 @ x) per local expert
    combine    the reverse all-to-all, the copies back in token order, weighted by their
               routing weights and summed over k in fp32 (score_apply "pre": the tokens were
               weighted before the experts instead)
    shared     + the shared expert (x sigmoid(shared gate) where the block has one)

Expert parameters are marked as DeepSpeed marks them (`allreduce = False`, `group_name =
"ep_size_<N>"`): the engine puts them in "moe" optimizer groups whose gradients are summed over
the expert-data-parallel group; everything else is averaged over all data-parallel ranks.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import dispatch
from .detect import LayerSpec
from .experts import GroupedExperts
from .presets import AutoEPError
from .routing import route


class AutoEPMoELayer(nn.Module):
    def __init__(self, spec: LayerSpec, router: nn.Module, experts: GroupedExperts, ep_size: int, ep_rank: int,
                 ep_group, shared: Optional[nn.Module] = None, shared_gate: Optional[nn.Module] = None,
                 combine_impl: str = "weighted_sum"):
        super().__init__()
        self.spec = spec
        self.ep_size, self.ep_rank, self.ep_group = ep_size, ep_rank, ep_group
        self.num_experts = spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.top_k = spec.top_k
        self.ep_group_name = f"ep_size_{ep_size}"
        self.combine_impl = combine_impl
        self.source_layout = None  # the block's state-dict layout, set by convert.swap (for hf_state_dict)
        # the block's own children, under their own names (state-dict keys stay Hugging Face's)
        self.add_module(spec.router_name, router)
        self.add_module("experts", experts)
        if shared is not None:
            self.add_module(spec.shared_experts_name, shared)
        if shared_gate is not None:
            self.add_module(spec.shared_experts_gate_name, shared_gate)
        for p in experts.parameters():
            p.allreduce = False
            p.group_name = self.ep_group_name
        self._label = f"autoep {spec.name}"

    @property
    def router(self) -> nn.Module:
        return getattr(self, self.spec.router_name)

    def extra_repr(self) -> str:
        return (f"name={self.spec.name}, family={self.spec.family}, experts={self.num_experts}, top_k={self.top_k}, "
                f"ep_size={self.ep_size}, ep_rank={self.ep_rank}")

    def _correction_bias(self) -> Optional[torch.Tensor]:
        path = self.spec.correction_bias_path
        if path is None:
            return None
        owner = self if path == "" else self.get_submodule(path)
        return owner.e_score_correction_bias

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        out = self.router(x)
        logits = out[0] if isinstance(out, (tuple, list)) else out
        if not torch.is_tensor(logits) or tuple(logits.shape) != (x.shape[0], self.num_experts):
            raise AutoEPError(f"expert_parallel: the router '{self.spec.router_name}' of '{self.spec.name}' did not "
                              f"return logits [tokens, {self.num_experts}] as its first output")
        return logits

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise AutoEPError(f"expert_parallel: '{self.spec.name}' has no expert-parallel group; run the model "
                              "through deepspeed.initialize")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, chosen = route(self._logits(x), self.spec.routing, self._correction_bias())
        k = self.top_k
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token copies by global expert
        rows = x.index_select(0, order // k)
        if self.spec.score_apply == "pre":
            rows = (rows.float() * weights.reshape(-1)[order].unsqueeze(-1)).to(rows.dtype)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.ep_size == 1:
            out = self.experts(rows, counts.tolist())
        else:
            plan = dispatch.plan(counts, self.ep_size, self.ep_group, self._label)
            got = dispatch.AllToAllV.apply(rows, plan.send, plan.recv, self.ep_group, f"{self._label} dispatch")
            done = self.experts(got.index_select(0, plan.regroup), plan.per_expert).index_select(0, plan.restore)
            out = dispatch.AllToAllV.apply(done, plan.recv, plan.send, self.ep_group, f"{self._label} combine")
        copies = torch.zeros_like(out).index_copy(0, order, out).reshape(x.shape[0], k, -1)
        if self.spec.score_apply == "pre":
            y = copies.sum(1)
        elif self.combine_impl == "legacy_bmm":
            y = torch.bmm(weights.unsqueeze(1), copies.float()).squeeze(1).to(x.dtype)
        else:
            y = (copies.float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)
        if self.spec.shared_experts_name:
            s = getattr(self, self.spec.shared_experts_name)(x)
            if self.spec.shared_experts_gate_name:
                s = torch.sigmoid(getattr(self, self.spec.shared_experts_gate_name)(x)) * s
            y = y + s.reshape(y.shape)
        return y.reshape(shape)
