"""The fused AutoTP layer cases shared by scripts/make_ds_fused_layer_fixtures.py (DeepSpeed's
answers) and tests/runtime/tensor_parallel/test_tp_fused_layers.py (ours): one definition of
the inputs, so the two sides cannot drift.

A case: kind ("gateup" or "qkv"), the block class name its layout is read from (qkv), the
linear's in/out features and bias, the tensor-parallel size, the layer name, and the model's
AutoTPMeta fields. The blocks are tiny modules named as the model blocks DeepSpeed recognises.
"""
from __future__ import annotations

import torch


def _meta(kv=None, heads=None, embd=None, grain=1):
    return {"num_kv_heads": kv, "num_attention_heads": heads, "n_embd": embd, "tp_grain_size": grain}


CASES = [
    {"kind": "gateup", "block": None, "in": 3, "out": 10, "bias": True, "tp": 2, "name": "dense_h_to_4h",
     "meta": _meta()},
    {"kind": "gateup", "block": None, "in": 2, "out": 22, "bias": True, "tp": 3, "name": "dense_h_to_4h",
     "meta": _meta(kv=2, grain=2)},
    {"kind": "gateup", "block": None, "in": 2, "out": 16, "bias": False, "tp": 4, "name": "dense_h_to_4h",
     "meta": _meta(grain=4)},
    {"kind": "qkv", "block": "MyBlock", "in": 4, "out": 24, "bias": True, "tp": 3, "name": "query_key_value",
     "meta": _meta(kv=4)},
    {"kind": "qkv", "block": "BloomBlock", "in": 3, "out": 18, "bias": True, "tp": 4, "name": "query_key_value",
     "meta": _meta()},
    {"kind": "qkv", "block": "FalconDecoderLayer", "in": 2, "out": 12, "bias": False, "tp": 2,
     "name": "query_key_value", "meta": _meta(kv=3)},
    {"kind": "qkv", "block": "GLMBlock", "in": 8, "out": 16, "bias": True, "tp": 3, "name": "query_key_value",
     "meta": _meta(kv=2, embd=8)},
    {"kind": "qkv", "block": "GLMBlock", "in": 6, "out": 18, "bias": True, "tp": 2, "name": "query_key_value",
     "meta": _meta(kv=3)},
    {"kind": "qkv", "block": "QWenBlock", "in": 12, "out": 36, "bias": True, "tp": 3, "name": "c_attn",
     "meta": _meta(kv=4, embd=12)},
    {"kind": "qkv", "block": "Phi3DecoderLayer", "in": 8, "out": 16, "bias": False, "tp": 2, "name": "qkv_proj",
     "meta": _meta(kv=2, heads=4, grain=2)},
]

# Layouts DeepSpeed cannot split per sub-parameter (it refuses to gather them), and a QWen
# split that would leave a rank without a query column (refused when the split is frozen).
REFUSED = [
    {"kind": "qkv", "block": "CodeGenBlock", "in": 4, "out": 24, "bias": False, "tp": 2, "rank": 0,
     "name": "qkv_proj", "meta": _meta(kv=8, embd=4)},
    {"kind": "qkv", "block": "GPTBigCodeBlock", "in": 4, "out": 12, "bias": False, "tp": 2, "rank": 1,
     "name": "c_attn", "meta": _meta(kv=4, embd=8)},
    {"kind": "qkv", "block": "QWenBlock", "in": 12, "out": 36, "bias": False, "tp": 16, "rank": 15,
     "name": "c_attn", "meta": _meta(kv=4, embd=12)},
]


class _Attention(torch.nn.Module):
    def __init__(self, split_size: int):
        super().__init__()
        self.split_size = split_size


def block_for(name: str, split_size: int) -> torch.nn.Module:
    """A module printed as `name(...)`, holding an attention with QWen's split_size."""
    def init(self):
        torch.nn.Module.__init__(self)
        self.attn = _Attention(split_size)
    return type(name, (torch.nn.Module,), {"__init__": init})()


def full_linear(fin: int, fout: int, bias: bool) -> torch.nn.Linear:
    lin = torch.nn.Linear(fin, fout, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(fout * fin, dtype=torch.float32).view(fout, fin))
        if bias:
            lin.bias.copy_(torch.arange(fout, dtype=torch.float32) + 1000)
    return lin

# DeepSpeed's layer-spec layers with a `shape` (SubParamLinearLayer: column, dim 0;
# SubParamLinearAllreduce: row, dim 1): (kind, in, out, shape, tp, name, meta).
SHAPE_CASES = [
    {"kind": "column", "in": 3, "out": 16, "shape": [2, -1], "tp": 2, "name": "mlp.gate_up_proj", "meta": _meta()},
    {"kind": "column", "in": 2, "out": 16, "shape": [[8, 4, 4], -1], "tp": 2, "name": "self_attn.qkv_proj",
     "meta": _meta()},
    {"kind": "column", "in": 2, "out": 36, "shape": [[12, 12, 12], -1], "tp": 2, "name": "self_attn.qkv_proj",
     "meta": _meta(kv=3)},
    {"kind": "column", "in": 2, "out": 11, "shape": [-1, -1], "tp": 3, "name": "proj", "meta": _meta()},
    {"kind": "row", "in": 16, "out": 3, "shape": [-1, [8, 4, 4]], "tp": 2, "name": "self_attn.o_proj",
     "meta": _meta()},
    {"kind": "row", "in": 18, "out": 2, "shape": [-1, 3], "tp": 4, "name": "self_attn.o_proj", "meta": _meta(kv=3)},
]
