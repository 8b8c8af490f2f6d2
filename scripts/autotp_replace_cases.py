"""The model and layer specs shared by scripts/make_ds_autotp_replace_fixtures.py (run under real
DeepSpeed) and tests/runtime/tensor_parallel/test_autotp_replace_ds.py (our side): a small
decoder with an embedding, two blocks (attention with fewer kv heads than query heads, a fused
projection cut per sub-parameter, an MLP), a norm and an output head, its weights `arange`
values so a recorded cut says which rows and columns a rank keeps.

`FakeGroup` stands for a tensor-parallel group of `size` ranks seen from rank `rank`: both sides
answer comm's get_rank / get_world_size for it, so one process builds every rank's layers
(nothing is communicated while AutoTP cuts).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

HIDDEN, HEADS, KV_HEADS, VOCAB = 12, 6, 3, 10

PARTITION_CONFIG = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.self_attn\.(q|k|v)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.mlp\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
         "partition_dim": 0},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.mlp\.gate\.weight$"], "partition_type": "skip"},
        {"patterns": [r"embed_tokens\.weight$"], "partition_type": "row"},
        {"patterns": [r"lm_head\.weight$"], "partition_type": "column", "gather_output": True},
    ],
}


class Attention(nn.Module):

    def __init__(self):
        super().__init__()
        head_dim = HIDDEN // HEADS
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=True)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * head_dim, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=True)
        self.num_heads = HEADS
        self.num_key_value_heads = KV_HEADS
        self.hidden_size = HIDDEN


class Mlp(nn.Module):

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, 2, bias=False)  # a router left whole
        self.gate_up_proj = nn.Linear(HIDDEN, 16, bias=True)
        self.down_proj = nn.Linear(8, HIDDEN, bias=False)
        self.hidden_size = HIDDEN


class Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.self_attn = Attention()
        self.mlp = Mlp()
        self.norm = nn.LayerNorm(HIDDEN)


class Decoder(nn.Module):

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(model_type="toy", num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                                      hidden_size=HIDDEN)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block() for _ in range(2)])
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for i, (_, p) in enumerate(sorted(self.named_parameters())):
                p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) / 100 + i)


class FakeGroup:
    """A tensor-parallel group of `size` ranks, seen from `rank`."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def fake_comm(module, real_get_rank, real_get_world_size):
    """get_rank / get_world_size for `module` (deepspeed.comm) that answer a FakeGroup."""

    def get_rank(group=None):
        return group.rank if isinstance(group, FakeGroup) else real_get_rank(group=group)

    def get_world_size(group=None):
        return group.size if isinstance(group, FakeGroup) else real_get_world_size(group=group)

    return get_rank, get_world_size


def record(model: nn.Module) -> dict:
    """Every module's class, its parameters (shape, values, trainable) and the attributes AutoTP
    divides, after the walk."""
    out = {}
    for name, m in model.named_modules():
        if not name:
            continue
        entry = {"class": type(m).__name__}
        params = {}
        for pname, p in m.named_parameters(recurse=False):
            params[pname] = {"shape": list(p.shape), "values": p.detach().reshape(-1).tolist(),
                             "requires_grad": bool(p.requires_grad)}
        if params:
            entry["params"] = params
        attrs = {a: getattr(m, a) for a in ("num_heads", "num_key_value_heads", "hidden_size") if hasattr(m, a)}
        if attrs:
            entry["attrs"] = attrs
        out[name] = entry
    return out
