"""Make tests/data/ds_autotp_uc.json with real DeepSpeed (0.19.8, CPU): the universal-checkpoint
metadata its AutoTP layers write on their parameters, the model-level info
`collect_autotp_universal_checkpoint_info` publishes, each rank's cut of the fused layers, and
each rank's piece `_resolve_autotp_partition` restores from a full tensor.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_autotp_uc_fixtures.py

One process, no process group, as DeepSpeed's own unit tests do: every layer is built with
mp_group=None (tp 1, nothing cut), then given the group's size and a rank by hand, its split
re-frozen (`_freeze_partition_sizes`, or the sub-parameter widths `_subparam_shard_widths`),
re-cut (`_tp_partition`) and its metadata re-marked (`_mark_uc_metadata`). Full weights are
`arange` values, so the recorded cuts say which rows/columns each rank keeps. DeepSpeed 0.19.8's
`affine_map` (a layout description it publishes next to the patterns) is left out of the
records: dslaunch does not produce it. tests/runtime/tensor_parallel/test_autotp_uc_ds.py
replays our side.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_layer_cases import full_linear  # noqa: E402  the same reference weights as the fused-layer cases

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "ds_autotp_uc.json")

# (case id, layer class, in, out, bias, extra kwargs, tp); shape specs are lists in JSON
LAYERS = [
    ("column", "LinearLayer", 8, 101, True, {}, 2),
    ("column_lm_head", "LinearLayer", 4, 10, True, {"name": "lm_head"}, 3),
    ("row", "LinearAllreduce", 10, 4, True, {}, 3),
    ("subparam_qkv_even", "SubParamLinearLayer", 2, 12, True, {"shape": [3, -1], "partition_dim": 0}, 2),
    ("subparam_qkv_gqa", "SubParamLinearLayer", 2, 12, True, {"shape": [[6, 3, 3], -1], "partition_dim": 0}, 3),
    ("subparam_3d", "SubParamLinearLayer", 3, 12, True, {"shape": [2, 2, 3, 3], "partition_dim": 0}, 2),
    ("subparam_row", "SubParamLinearAllreduce", 6, 4, True, {"shape": [4, [4, 2]], "partition_dim": 1}, 2),
    ("gate_up", "GateUpPack_LinearLayer", 4, 12, False, {}, 2),
    ("gate_up_uneven", "GateUpPack_LinearLayer", 3, 10, True, {}, 4),
]


def plain(value):
    """JSON's view of a metadata value (tuples become lists), affine maps dropped."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k not in ("affine_map", "affine_map_info")}
    if isinstance(value, (list, tuple, torch.Size)):
        return [plain(v) for v in value]
    return value


def spec(value):
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def build(L, cls_name, fin, fout, bias, kwargs, tp, rank):
    """The layer as DeepSpeed's tests make one for rank `rank` of a `tp` group."""
    cls = getattr(L, cls_name)
    kw = dict(kwargs)
    if "shape" in kw:
        kw["shape"] = spec(kw["shape"])
    layer = cls(full_linear(fin, fout, bias), mp_group=None, **kw)
    layer.tp_world_size, layer.tp_index = tp, rank
    if cls_name.startswith("SubParamLinear"):
        sizes = layer._subparam_sizes or (layer._logical_shape[layer.partition_dim],)
        layer._subparam_shard_widths = L._subparam_shard_widths(sizes, tp, layer.tp_meta, layer.name)
    else:
        layer._freeze_partition_sizes(fout if cls_name != "LinearAllreduce" else fin)
    layer._tp_partition([layer.weight, layer.bias])
    layer._mark_uc_metadata()
    return layer


def main() -> int:
    import deepspeed.module_inject.layers as L
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.checkpoint.universal_checkpoint import _narrow_sub_params, _resolve_autotp_partition
    L.set_autotp_mode(training=True)
    layers = []
    for case, cls_name, fin, fout, bias, kwargs, tp in LAYERS:
        ranks = []
        for rank in range(tp):
            layer = build(L, cls_name, fin, fout, bias, kwargs, tp, rank)
            model = torch.nn.Module()
            model.proj = layer
            info = plain(L.collect_autotp_universal_checkpoint_info(model))
            info.pop("affine_map", None)
            rec = {"info": info, "weight": layer.weight.detach().tolist(),
                   "weight_meta": plain(getattr(layer.weight, DS_AUTOTP_UC_META))}
            if layer.bias is not None:
                rec["bias"] = layer.bias.detach().tolist()
                rec["bias_meta"] = plain(getattr(layer.bias, DS_AUTOTP_UC_META))
            # the restore: this rank's piece of the full (arange) parameter, by its metadata
            for pname in ("weight", "bias"):
                param = getattr(layer, pname)
                if param is None:
                    continue
                full = full_linear(fin, fout, bias)
                piece = _resolve_autotp_partition(param, {}, getattr(full, pname).detach().flatten(), rank, tp)
                rec[f"restored_{pname}"] = None if piece is None else piece.tolist()
            ranks.append(rec)
        layers.append({"case": case, "cls": cls_name, "in": fin, "out": fout, "bias": bias, "kwargs": kwargs,
                       "tp": tp, "ranks": ranks})

    # _narrow_sub_params on its own: (sizes, widths or None, tp, version)
    narrow = []
    for sizes, widths, tp, version in [((8, 2, 2), [[2, 2, 2, 2], [1, 1, 0, 0], [1, 1, 0, 0]], 4, 0.4),
                                       ((8, 4, 4), None, 2, 0.3), ((6, 3, 3), [[4, 2], [2, 1], [2, 1]], 2, 0.4),
                                       ((5, 3), [[3, 2], [2, 1]], 2, 0.4)]:
        full = torch.arange(sum(sizes) * 3, dtype=torch.float32).view(sum(sizes), 3)
        out = [_narrow_sub_params(full, 0, sizes, widths, r, tp, version).tolist() for r in range(tp)]
        narrow.append({"sizes": list(sizes), "widths": widths, "tp": tp, "version": version, "ranks": out})
    # refusals: an uneven sub-parameter without widths (pre-0.4), and a layout the layer could not describe
    refusals = []
    try:
        _narrow_sub_params(torch.zeros(10, 2), 0, (6, 4), None, 0, 4, 0.3)
    except AssertionError as exc:
        refusals.append({"case": "legacy_uneven", "error": type(exc).__name__, "message": str(exc)})
    param = torch.nn.Parameter(torch.zeros(6, 4))
    setattr(param, DS_AUTOTP_UC_META, L._build_param_uc_restore_meta(partition_type="column", partition_dim=0,
                                                                     logical_shape=(12, 4), original_shape=(12, 4),
                                                                     unsupported_reason="a reason"))
    try:
        _resolve_autotp_partition(param, {}, torch.zeros(48), 0, 2)
    except RuntimeError as exc:
        refusals.append({"case": "unsupported", "error": type(exc).__name__, "message": str(exc)})

    import deepspeed
    with open(OUT, "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "layers": layers, "narrow": narrow, "refusals": refusals},
                  f, indent=1)
        f.write("\n")
    print(f"wrote {len(layers)} layer cases, {len(narrow)} narrowings to {os.path.normpath(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
