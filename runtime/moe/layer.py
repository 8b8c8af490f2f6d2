"""DeepSpeed's MoE layer (`deepspeed.moe.layer.MoE`): a gate, this rank's experts, and the
all-to-all that brings every expert its tokens from the whole expert-parallel group.

    moe = MoE(hidden_size=H, expert=nn.Sequential(...), num_experts=8, ep_size=2, k=1)
    out, l_aux, exp_counts = moe(x)          # x: [..., H]

Forward, per rank (GShard's algorithm 2):

    gate          logits = x @ wg (fp32), then gating.route(): expert, slot and weight per
                  route, the aux loss, the tokens each expert was chosen by (local counts)
    encode        tokens copied into a [experts, capacity, H] buffer (unused slots zero)
    all-to-all    over the mesh's `expert` group: the block of experts held by group rank j
                  goes to rank j, which receives [ep_size, local experts, capacity, H]
    experts       local expert i runs on [:, i] (its tokens from every rank)
    all-to-all    the outputs go back where their tokens came from
    decode        each token's output is the weighted sum of its routes' expert outputs

Experts are `num_experts / ep_size` copies of `expert`; expert-parallel rank r holds global
experts r x local .. (r + 1) x local - 1. The engine (deepspeed.initialize) finds MoE
layers, builds its mesh with `expert = ep_size` and hands each layer its group through
`set_expert_group`; with ep_size 1 no group is needed.

Refused in one line (a ConfigError, exit 2 from a script): num_experts not divisible by
ep_size, k above num_experts, an unknown noisy_gate_policy, use_tutel (the Tutel kernels
are not part of dslaunch), enable_expert_tensor_parallelism (no tensor-parallel experts).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..core import comm
from ..core.strict import ConfigError
from . import gating
from .experts import Experts
# DeepSpeed's all-to-all (sharded_moe._AllToAll, apply(group, input)): scripts and DeepSpeed's tests
# patch that one to watch the layer's exchanges
from .sharded import _AllToAll


class MoEError(ConfigError):
    """A bad MoE argument or layout, as the one line the user should see."""


def encode(x: torch.Tensor, routing: gating.Routing) -> torch.Tensor:
    """[tokens, H] -> the [experts, capacity, H] dispatch buffer (one token per slot)."""
    k, s = routing.indices.shape
    e, c = routing.num_experts, routing.capacity
    slots = routing.slots().reshape(-1)
    src = x.unsqueeze(0).expand(k, s, x.shape[-1]).reshape(k * s, x.shape[-1])
    buf = x.new_zeros(e * c + 1, x.shape[-1]).index_add(0, slots, src)
    return buf[:-1].reshape(e, c, x.shape[-1])


def decode(expert_out: torch.Tensor, routing: gating.Routing) -> torch.Tensor:
    """[experts, capacity, H] outputs -> [tokens, H]: each token's routes weighted and summed
    (in fp32, cast back to the outputs' dtype)."""
    h = expert_out.shape[-1]
    k, s = routing.indices.shape
    padded = torch.cat([expert_out.reshape(-1, h), expert_out.new_zeros(1, h)])
    routed = padded.index_select(0, routing.slots().reshape(-1)).reshape(k, s, h)
    return (routed * routing.weights.unsqueeze(-1)).sum(0).to(expert_out.dtype)


class TopKGate(nn.Module):
    """The router: a bias-free linear map to one logit per expert, then the gating."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = True, use_rts: bool = True, top2_2nd_expert_sampling: bool = True):
        super().__init__()
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling
        self.ep_group = None

    def _agree_max(self, local: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(local, op=comm.ReduceOp.MAX, group=self.ep_group, label="moe capacity (max over experts)")
        return local

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> gating.Routing:
        inp = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            inp = gating.jitter(inp)
        logits = F.linear(inp, self.wg.weight.float())
        return gating.route(
            logits, self.k, self.capacity_factor if self.training else self.eval_capacity_factor, self.min_capacity,
            used_token=used_token, noisy_gate_policy=self.noisy_gate_policy if self.training else None,
            drop_tokens=self.drop_tokens, use_rts=self.use_rts,
            second_expert_sampling=self.top2_2nd_expert_sampling,
            agree_max=self._agree_max if self.ep_group is not None else None)


class MOELayer(nn.Module):
    """Gate + experts + the two all-to-alls (see the module docstring)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size, self.num_local_experts = ep_group_name, ep_size, num_local_experts
        self.ep_group = None
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def _set_ep_group(self, group) -> None:
        self.ep_group = group
        self.gate.ep_group = group

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise MoEError(f"MoE(ep_size={self.ep_size}): no expert-parallel group; run the model through "
                           "deepspeed.initialize (which builds the expert mesh) before calling it")
        h = x.shape[-1]
        tokens = x.reshape(-1, h)
        routing = self.gate(tokens, used_token)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts
        buf = encode(tokens, routing)
        if self.ep_size > 1:
            buf = _AllToAll.apply(self.ep_group, buf)
        out = self.experts(buf.reshape(self.ep_size, self.num_local_experts, -1, h))
        out = out.reshape(self.ep_size * self.num_local_experts, -1, h)
        if self.ep_size > 1:
            out = _AllToAll.apply(self.ep_group, out)
        return decode(out, routing).reshape(x.shape)


class MoE(nn.Module):
    """DeepSpeed's MoE layer; arguments and defaults are DeepSpeed's.

    forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        _check_args(num_experts, ep_size, k, noisy_gate_policy, use_tutel, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        # built in DeepSpeed's order (experts copied, then the gate, then the residual
        # coefficient) so that one seed gives both the same weights
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_expert_group(self, group) -> None:
        """The process group of this rank's expert-parallel group (`ep_size` ranks)."""
        self.deepspeed_moe._set_ep_group(group)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        raise MoEError("MoE.set_deepspeed_parallelism: dslaunch builds the expert groups in deepspeed.initialize "
                       "(from the model's MoE layers); do not call it")

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:  # PR-MoE: a dense MLP beside the experts, mixed by a learned coefficient
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check_args(num_experts, ep_size, k, noisy_gate_policy, use_tutel, enable_expert_tensor_parallelism) -> None:
    for name, v in (("num_experts", num_experts), ("ep_size", ep_size), ("k", k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise MoEError(f"MoE: {name} {v!r} must be a positive integer")
    if num_experts % ep_size:
        raise MoEError(f"MoE: num_experts {num_experts} is not divisible by ep_size {ep_size}")
    if k > num_experts:
        raise MoEError(f"MoE: k {k} is more than num_experts {num_experts}")
    if noisy_gate_policy not in gating.NOISY_GATE_POLICIES:
        raise MoEError(f"MoE: noisy_gate_policy {noisy_gate_policy!r} is not one of None, 'Jitter', 'RSample'")
    if use_tutel:
        raise MoEError("MoE: use_tutel=True is not supported (dslaunch has no Tutel kernels); remove it")
    if enable_expert_tensor_parallelism:
        raise MoEError("MoE: enable_expert_tensor_parallelism=True is not supported (experts are not split "
                       "over tensor-parallel ranks here); remove it")
