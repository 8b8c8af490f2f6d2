"""Make tests/data/ds_fused_layers.json with real DeepSpeed (0.19.8, CPU): how its AutoTP fused
column layers `GateUpPack_LinearLayer` (packed gate+up) and `fused_LinearLayer` (fused qkv of a
Bloom / Falcon / GLM / QWen / Phi-3 block) cut a full nn.Linear for each rank of a
tensor-parallel group, uneven and empty pieces included, and which layouts they cannot split
per sub-parameter (CodeGen, GPTBigCode) or refuse (a QWen rank left without a query column);
and how `SubParamLinearLayer` / `SubParamLinearAllreduce` cut by a layer spec's 2-D `shape`.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_fused_layer_fixtures.py

One process, no process group: each layer is built with mp_group=None (tp 1, nothing cut) and
the model's AutoTPMeta, then given the group's size and a rank by hand and re-cut with its own
`_freeze_partition_sizes` and `_tp_partition`, as DeepSpeed's unit tests do. The full weights
are `arange` values, so the recorded shards say exactly which rows each rank keeps.
Recorded per case: the sub-parameter sizes and per-rank widths, each rank's weight and bias
shard, and QWen's attn.split_size per rank. The block classes are named as the model blocks
DeepSpeed recognises (it reads the layout from the block's printed form); fused_layer_cases.py
defines them once for this script and the test.
SubParamLinearLayer / SubParamLinearAllreduce (a layer spec's `shape`) resolve their widths in
the constructor only, from the group's size: after setting the size and rank by hand this script
asks DeepSpeed's own `_subparam_shard_widths` for the widths again (what the constructor would
have computed in a group of that size) and lets the layer's `_tp_partition` cut.
tests/runtime/tensor_parallel/test_tp_fused_layers.py replays our side.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_layer_cases import CASES, REFUSED, SHAPE_CASES, block_for, full_linear  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "ds_fused_layers.json")


def build(case: dict, tp: int, rank: int):
    from deepspeed.module_inject.layers import GateUpPack_LinearLayer, fused_LinearLayer
    from deepspeed.module_inject.tp_shard import AutoTPMeta
    meta = AutoTPMeta(**case["meta"])
    linear = full_linear(case["in"], case["out"], case["bias"])
    block = None
    if case["kind"] == "gateup":
        layer = GateUpPack_LinearLayer(linear, mp_group=None, name=case["name"], tp_meta=meta)
    else:
        block = block_for(case["block"], case["out"] // 3)
        layer = fused_LinearLayer(linear, None, skip_partition=True, name=case["name"], fused_module=block,
                                  tp_meta=meta)
    layer.tp_world_size, layer.tp_index = tp, rank
    layer._freeze_partition_sizes(case["out"])
    return layer, block


def shape_case(case: dict) -> dict:
    from deepspeed.module_inject import layers
    from deepspeed.module_inject.tp_shard import AutoTPMeta
    meta = AutoTPMeta(**case["meta"])
    cls, dim = (layers.SubParamLinearLayer, 0) if case["kind"] == "column" else (layers.SubParamLinearAllreduce, 1)
    ranks = []
    for rank in range(case["tp"]):
        layer = cls(full_linear(case["in"], case["out"], True), None, shape=case["shape"], partition_dim=dim,
                    name=case["name"], tp_meta=meta)
        layer.tp_world_size, layer.tp_index = case["tp"], rank
        layer._subparam_shard_widths = layers._subparam_shard_widths(
            layer._subparam_sizes or (layer._logical_shape[dim], ), case["tp"], meta, case["name"])
        layer._tp_partition([layer.weight, layer.bias])
        ranks.append({"weight": layer.weight.detach().tolist(), "bias": layer.bias.detach().tolist()})
    return {**case, "subparam_sizes": list(layer._subparam_sizes) if layer._subparam_sizes else None,
            "widths": [list(w) for w in layer._subparam_shard_widths], "ranks": ranks}


def main() -> int:
    from deepspeed.module_inject.layers import set_autotp_mode
    set_autotp_mode(training=True)
    cases = []
    for case in CASES:
        ranks = []
        for rank in range(case["tp"]):
            layer, block = build(case, case["tp"], rank)
            layer._tp_partition([layer.weight, layer.bias])
            ranks.append({"weight": layer.weight.detach().tolist(),
                          "bias": layer.bias.detach().tolist() if layer.bias is not None else None,
                          "split_size": getattr(getattr(block, "attn", None), "split_size", None)})
        cases.append({**case, "subparam_sizes": list(layer._subparam_sizes),
                      "widths": [list(w) for w in layer._subparam_shard_widths], "ranks": ranks})
    refused = []
    for case in REFUSED:
        try:
            layer, _ = build(case, case["tp"], case["rank"])
        except RuntimeError as err:
            refused.append({**case, "at": "build", "error": str(err)})
            continue
        assert layer._subparam_sizes is None, case
        try:
            layer.gather_params([torch.nn.Parameter(torch.zeros(case["out"] // case["tp"], case["in"])), None])
        except RuntimeError as err:
            refused.append({**case, "at": "gather", "error": str(err)})
            continue
        raise AssertionError(f"DeepSpeed accepted {case}")
    shaped = [shape_case(case) for case in SHAPE_CASES]
    import deepspeed
    with open(OUT, "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases, "refused": refused, "shaped": shaped}, f,
                  indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases and {len(refused)} refusals to {os.path.normpath(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
