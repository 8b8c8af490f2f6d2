"""The experts one rank holds after the swap: its share of every projection, stacked.

    w1  [local experts, ffn, hidden]   gate projection
    w3  [local experts, ffn, hidden]   up projection
    w2  [local experts, hidden, ffn]   down projection

(DeepSpeed's names and layout, whatever the source model called them: a fused gate+up tensor
is split into w1 and w3.) `forward(x, counts)` takes the tokens grouped by local expert,
`counts[i]` rows for expert i, and returns each row's expert output in the same order:
w2 @ act(w1 @ x, w3 @ x). Either one torch._grouped_mm per projection over all local experts
(`use_grouped_mm`, each group padded to 16 rows as that kernel wants its strides), or one matmul
per expert.

The expert MLP forms (DeepSpeed's EXPERT_ACTIVATIONS): they are different functions, and a model
trained with one does not run correctly with another.

    swiglu          silu(gate) * up                 Mixtral, Qwen, OLMoE, DeepSeek
    geglu_tanh      gelu_tanh(gate) * up
    swiglu_clamped  silu(clamp(gate)) * clamp(up)
    swiglu_oai      (clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate))   MiniMax-M3
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ...core.config.expert_parallel import EXPERT_ACTIVATIONS

GROUP_ROWS = 16  # torch._grouped_mm reads each group at a 16-byte-aligned stride


@dataclass(frozen=True)
class Activation:
    fn: Callable[[torch.Tensor, torch.Tensor, float, float], torch.Tensor]
    # the elementwise function applied to `gate` where the form is gate_fn(gate) * up; compared
    # with the experts' act_fn to catch a preset naming the wrong form (None: not such a product)
    gate_fn: Optional[Callable[[torch.Tensor], torch.Tensor]]
    uses_limit: bool = False


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: Dict[str, Activation] = {
    "swiglu": Activation(lambda g, u, a, lim: F.silu(g) * u, F.silu),
    "geglu_tanh": Activation(lambda g, u, a, lim: _gelu_tanh(g) * u, _gelu_tanh),
    "swiglu_clamped": Activation(lambda g, u, a, lim: F.silu(g.clamp(max=lim)) * u.clamp(min=-lim, max=lim), F.silu,
                                 uses_limit=True),
    "swiglu_oai": Activation(lambda g, u, a, lim: (u.clamp(min=-lim, max=lim) + 1.0)
                             * (g.clamp(max=lim) * torch.sigmoid(g.clamp(max=lim) * a)), None, uses_limit=True),
}
assert tuple(ACTIVATIONS) == EXPERT_ACTIVATIONS


def grouped_mm_problem(hidden: int, ffn: int, dtype: torch.dtype) -> Optional[str]:
    """Why torch._grouped_mm cannot run these experts (None: it can)."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm is not available in this PyTorch build"
    size = torch.empty((), dtype=dtype).element_size()
    for name, n in (("hidden", hidden), ("ffn", ffn)):
        if (n * size) % 16:
            return f"its rows must be multiples of 16 bytes, and {name} size {n} in {dtype} is {n * size} bytes"
    return None


class GroupedExperts(nn.Module):
    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, activation: str = "swiglu",
                 alpha: float = 1.702, limit: float = 7.0, use_grouped_mm: bool = True, fused_gate_up: bool = False):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Parameter(w1), nn.Parameter(w2), nn.Parameter(w3)
        for p in (self.w1, self.w2, self.w3):
            p.is_expert_group = True  # DeepSpeed's mark: Muon orthogonalises each expert's matrix apart
        self.num_local_experts = w1.shape[0]
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.use_grouped_mm, self.fused_gate_up = use_grouped_mm, fused_gate_up

    def extra_repr(self) -> str:
        e, f, h = self.w1.shape
        return f"local_experts={e}, hidden={h}, ffn={f}, activation={self.activation}, grouped_mm={self.use_grouped_mm}"

    def _act(self, gate, up):
        return ACTIVATIONS[self.activation].fn(gate, up, self.alpha, self.limit)

    def forward(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        if self.use_grouped_mm:
            return self._grouped(x, counts)
        outs = []
        for e, rows in enumerate(torch.split(x, counts)):
            h = self._act(rows @ self.w1[e].to(x.dtype).t(), rows @ self.w3[e].to(x.dtype).t())
            outs.append(h @ self.w2[e].to(x.dtype).t())
        return torch.cat(outs) if outs else x.new_zeros(0, self.w2.shape[1])

    def _grouped(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        # each expert's rows start at a multiple of GROUP_ROWS; padding rows are zero and dropped
        padded = [-(-c // GROUP_ROWS) * GROUP_ROWS for c in counts]
        starts, at = [], 0
        for p in padded:
            starts.append(at)
            at += p
        total = max(at, GROUP_ROWS)
        dest = torch.cat([torch.arange(s, s + c, device=x.device) for s, c in zip(starts, counts)]) \
            if counts else torch.zeros(0, dtype=torch.long, device=x.device)
        xp = x.new_zeros(total, x.shape[1]).index_copy(0, dest, x)
        offs = torch.tensor([s + p for s, p in zip(starts, padded)], dtype=torch.int32, device=x.device)
        dtype = x.dtype
        if self.fused_gate_up:
            w13 = torch.cat([self.w1.to(dtype), self.w3.to(dtype)], dim=1)
            gate, up = torch._grouped_mm(xp, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        else:
            gate = torch._grouped_mm(xp, self.w1.to(dtype).transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(xp, self.w3.to(dtype).transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(self._act(gate, up).contiguous(), self.w2.to(dtype).transpose(-2, -1), offs=offs)
        return out.index_select(0, dest)
