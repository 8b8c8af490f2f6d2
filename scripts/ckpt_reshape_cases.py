"""The cases scripts/make_ds_ckpt_reshape_fixtures.py runs under DeepSpeed 0.19.8 and
tests/runtime/train/checkpoint/test_ckpt_reshape_vs_deepspeed.py replays with dslaunch: the
checkpoint-folder readers of deepspeed.checkpoint. `run(ds)` takes a namespace of the library's
callables (either side's) and returns plain JSON values; the folders are written here, with
torch only, so both sides read the same bytes.
"""
from __future__ import annotations

import itertools
import os
import tempfile
import types
from typing import Any, Callable, Dict, List

import torch

DEGREES = (1, 2, 3, 4)


def _outcome(fn: Callable[[], Any]) -> Any:
    """The value, or {"error": the first line} when the call refuses."""
    try:
        return fn()
    except Exception as exc:  # either library's refusal: DeepSpeed asserts, dslaunch raises CheckpointError
        return {"error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}


def _plain(value: Any) -> Any:
    if torch.is_tensor(value):
        return {"tensor": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# -- reshape maps -------------------------------------------------------------------------------

def reshapes(ds) -> Dict[str, Any]:
    """Every (pp, tp, dp) source to every target no larger, degrees 1-4 (pp*tp*dp <= 24)."""
    out = {}
    for src in itertools.product(DEGREES, repeat=3):
        if src[0] * src[1] * src[2] > 24:
            continue
        for tgt in itertools.product(*(range(1, d + 1) for d in src)):
            a, b = ds.model_3d_desc(*src), ds.model_3d_desc(*tgt)

            def maps(a=a, b=b):
                return [dict(m.map) for m in a.reshape(b)]

            out[f"{src}->{tgt}"] = {"can": a.can_reshape(b)[0], "maps": _outcome(maps)}
    grow = ds.model_3d_desc(1, 2, 2)
    out["grow"] = {"can": list(grow.can_reshape(ds.model_3d_desc(2, 2, 4))[1])}
    return out


# -- folders ------------------------------------------------------------------------------------

def _model_file(folder: str, mp: int, state: Dict[str, Any]) -> None:
    torch.save(state, os.path.join(folder, f"mp_rank_{mp:02d}_model_states.pt"))


def _zero_file(folder: str, prefix: str, dp: int, mp: int, state: Dict[str, Any]) -> None:
    torch.save(state, os.path.join(folder, f"{prefix}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"))


# (name, per model file its parallel dimensions or None, ZeRO files, Megatron layer_01 files)
LAYOUTS = [
    ("legacy-tp2-dp2", [None, None], 4, 0),
    ("legacy-layers-pp2-tp2", [None] * 4, 4, 2),
    ("dims-pp2-tp1-dp3", [{"pp_degree": 2, "tp_degree": 1}] * 2, 6, 0),
    ("dims-missing", [{"pp_degree": 2, "tp_degree": 1}, None], 4, 0),
    ("dims-disagree", [{"pp_degree": 2, "tp_degree": 1}, {"pp_degree": 1, "tp_degree": 2}], 4, 0),
    ("dims-count", [{"pp_degree": 2, "tp_degree": 2}] * 2, 4, 0),
    ("dims-zero-count", [{"pp_degree": 1, "tp_degree": 2}] * 2, 3, 0),
    ("dims-not-dict", [[2, 1]] * 2, 4, 0),
    ("dims-bool", [{"pp_degree": True, "tp_degree": 2}] * 2, 4, 0),
]


def _write_layout(folder: str, dims: List[Any], zero_count: int, layer_01: int) -> None:
    for mp, d in enumerate(dims):
        state = {"param_shapes": [{}]}
        if d is not None:
            state["checkpoint_parallel_dimensions"] = d
        _model_file(folder, mp, state)
    for i in range(zero_count):
        _zero_file(folder, "bf16_", i // len(dims), i % len(dims), {})
    for tp in range(layer_01):
        torch.save({}, os.path.join(folder, f"layer_01-model_{tp:02d}-model_states.pt"))


def descriptors(ds) -> Dict[str, Any]:
    out = {}
    for name, dims, zero_count, layer_01 in LAYOUTS:
        with tempfile.TemporaryDirectory() as folder:
            _write_layout(folder, dims, zero_count, layer_01)

            def describe(folder=folder):
                d = ds.get_model_3d_descriptor(folder)
                return [d.pp_degree, d.tp_degree, d.dp_degree]

            out[name] = _outcome(describe)
    return out


def _zero_state(dp: int, mp: int, padding: int) -> Dict[str, Any]:
    """A ZeRO-1/2 optimizer-states file: one param group of 5 + padding elements."""
    base = torch.arange(5 + padding, dtype=torch.float32) + 100 * dp + 10 * mp
    return {"optimizer_state_dict": {
        "base_optimizer_state": {"state": {0: {"exp_avg": base.clone(), "exp_avg_sq": base * 2, "step": 3}},
                                 "param_groups": [{"lr": 0.1, "params": [0]}]},
        "single_partition_of_fp32_groups": [base[:5].clone()],
        "group_paddings": [padding], "partition_count": [2], "zero_stage": 2},
        "param_shapes": [{"w": [5]}], "ds_version": "0.19.8", "tag": f"dp{dp}mp{mp}"}


def zero_states(ds) -> Dict[str, Any]:
    """A (pp 1, tp 2, dp 2) folder read per rank at (1, 2, 2), (1, 1, 1) and (1, 2, 1)."""
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for mp in range(2):
            _model_file(folder, mp, {"checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 2}})
            for dp in range(2):
                _zero_file(folder, "", dp, mp, _zero_state(dp, mp, padding=dp + 1))
        for tgt in ((1, 2, 2), (1, 1, 1), (1, 2, 1)):
            zc = ds.ZeROCheckpoint(folder)
            zc.reshape(ds.model_3d_desc(*tgt))
            for pp, tp, dp in itertools.product(*(range(d) for d in tgt)):
                for strip in (True, False):
                    key = f"{tgt}:{pp},{tp},{dp}:{strip}"
                    files = [os.path.basename(f) for f in zc.get_files_for_rank(pp, tp, dp)]
                    state = _outcome(lambda: _plain(zc.get_state_for_rank(pp, tp, dp, keys_to_ignore=["param_shapes"],
                                                                          strip_tensor_paddings=strip)))
                    out[key] = {"files": files, "state": state}
        out["src"] = [zc.get_src_pp_degree(), zc.get_src_tp_degree(), zc.get_src_dp_degree(), zc.get_src_world_size()]
    return out


def _layer_state(layer: int, tp: int) -> Dict[str, torch.Tensor]:
    base = torch.arange(4, dtype=torch.float32).reshape(2, 2) + 10 * layer + tp
    return {"input_layernorm.weight": base[0].clone(), "self_attention.dense.weight": base.clone(),
            "mlp.dense_h_to_4h.weight": base.clone() * 2}


def megatron(ds) -> Dict[str, Any]:
    """A Megatron-DeepSpeed folder saved at pp 2, tp 2, dp 2 (layers 01 embedding, 03-06
    transformer, 08 final norm), read at its own degrees and at tp 1, pp 1, dp 1."""
    out = {}
    with tempfile.TemporaryDirectory() as folder:
        for mp in range(4):
            _model_file(folder, mp, {"iteration": 7, "checkpoint_info": {"padded_vocab_size": 8},
                                     "args": {"hidden": 2}, "param_shapes": [{"w": [2, 2]}],
                                     "universal_checkpoint_info": {"v": 1}})
            for dp in range(2):
                _zero_file(folder, "", dp, mp, _zero_state(dp, mp, padding=0))
        for layer in (1, 3, 4, 5, 6, 8):
            for tp in range(2):
                torch.save(_layer_state(layer, tp), os.path.join(folder, f"layer_{layer:02d}-model_{tp:02d}-model_states.pt"))
        for degrees in ({}, {"tp_degree": 1, "pp_degree": 1, "dp_degree": 1}):
            def read(degrees=degrees):
                ck = ds.DeepSpeedCheckpoint(folder, **degrees)
                base = os.path.basename
                result = {"degrees": [ck.pp_degree, ck.tp_degree, ck.dp_degree, ck.world_size, ck.original_world_size],
                          "layer_keys": ck.layer_keys, "iteration": ck.get_iteration(), "args": ck.get_args(),
                          "info": ck.get_checkpoint_info(), "universal": ck.get_checkpoint_info("universal_checkpoint_info"),
                          "embedding_id": ck.get_embedding_layer_id(), "final_norm_id": ck.get_final_norm_layer_id(),
                          "pp_transformer": {str(k): v for k, v in ck.pp_to_transformer_map.items()}}
                for pp, tp in itertools.product(range(ck.pp_degree), range(ck.tp_degree)):
                    cell = f"{pp},{tp}"
                    result[f"files {cell}"] = [base(f) for f in ck.get_2d_parallel_files(tp_index=tp, pp_index=pp)]
                    result[f"transformer {cell}"] = _plain(ck.get_transformer_state(tp_index=tp, pp_index=pp))
                    for dp in range(ck.dp_degree):
                        result[f"zero {cell},{dp}"] = [base(f) for f in ck.get_zero_files(pp, tp, dp)]
                for tp in range(ck.tp_degree):
                    result[f"embedding {tp}"] = _plain(ck.get_embedding_state(tp))
                    result[f"final norm {tp}"] = [base(f) for f in ck.get_final_norm_files(tp)]
                result["metadata"] = _plain([[base(f), m] for f, m in ck.model_state_metadata])
                return result

            out[str(sorted(degrees.items()))] = _outcome(read)
    return out


# -- metadata -----------------------------------------------------------------------------------

def _record(prefix: str, **extra: Any) -> Dict[str, Any]:
    return {"moe_layer_id": 0, "module_path": "layers.0.mlp", "expert_key_prefix": prefix, "num_experts": 4,
            "num_local_experts": 2, "ep_size": 2, **extra}


def _meta(records: Any, flag: Any = False, shapes: Any = None) -> Dict[str, Any]:
    return {"param_shapes": {"w": [2]} if shapes is None else shapes, "ds_autoep_layers": records,
            "ds_config": {"use_data_before_expert_parallelism": flag}}


AUTOEP_CASES = {
    "none": [("a", _meta(None)), ("b", _meta(None))],
    "merged": [("a", _meta([_record("l0.experts")])), ("b", _meta([_record("l0.experts"), _record("l1.experts")]))],
    "not-list": [("a", _meta("malformed"))],
    "not-dict": [("a", _meta(["x"]))],
    "no-prefix": [("a", _meta([_record("")]))],
    "conflict": [("a", _meta([_record("l0.experts")])), ("b", _meta([_record("l0.experts", num_experts=8)]))],
    "flag-differs": [("a", _meta(None, True)), ("b", _meta(None, False))],
    "flag-not-bool": [("a", _meta(None, "yes"))],
    "shapes-not-dict": [("a", _meta(None, shapes="list"))],
    "config-not-dict": [("a", {"param_shapes": {}, "ds_autoep_layers": None, "ds_config": "str"})],
}


def autoep_metadata(ds) -> Dict[str, Any]:
    return {name: _outcome(lambda case=case: _plain(list(ds.aggregate_autoep(case))))
            for name, case in AUTOEP_CASES.items()}


def parallel_metadata(ds) -> Dict[str, Any]:
    ns = types.SimpleNamespace
    mpus = {"none": None,
            "megatron": ns(get_pipeline_model_parallel_world_size=lambda: 3,
                           get_tensor_model_parallel_world_size=lambda: 2),
            "deepspeed": ns(get_pipe_parallel_world_size=lambda: 2, get_slice_parallel_world_size=lambda: 4),
            "old": ns(get_model_parallel_world_size=lambda: 2)}
    return {name: ds.parallel_metadata(mpu) for name, mpu in mpus.items()}


def run(ds) -> Dict[str, Any]:
    return {"reshapes": reshapes(ds), "descriptors": descriptors(ds), "zero_states": zero_states(ds),
            "megatron": megatron(ds), "autoep_metadata": autoep_metadata(ds),
            "parallel_metadata": parallel_metadata(ds)}
