"""`ds_to_universal` for a checkpoint saved with tensor parallelism (AutoTP's mp_rank_XX slices,
ZeRO stage 1-3), as DeepSpeed 0.19.8's converter does it: each tensor rank's parameters are
made whole over its data-parallel ranks and written to a slice folder, and tp_merge.py joins
the tensor ranks' slices of each parameter by the checkpoint's universal_checkpoint_info.

The patterns come from the model states (DeepSpeed's AutoTP writes them); a dslaunch
checkpoint records its splits instead ("dslaunch"/"tensor_parallel_shards"), which
tp_merge.uc_info_from_shard_specs turns into the same patterns. Without either, the
conversion is refused as DeepSpeed's is (--inject_missing_state: every split parameter is
joined along dim 0, DeepSpeed's default). A pattern no parameter matched is refused unless
--no_strict, as DeepSpeed's strict check does. DeepSpeed 0.19.8's AutoTP also writes an affine
map, which its converter prefers; the patterns it keeps beside the map are read here instead
(the map is not), and every joined parameter is held to the map's logical shape.

The output is universal.py's layout: zero/<param>/<state>.pt, zero/optimizer_state.pt, and
every tensor rank's model-states file (its sharded module kept, as DeepSpeed copies them;
dslaunch's private record dropped). A parameter no optimizer holds (frozen) gets its fp32.pt
from the module: made whole by the recorded splits, else tensor rank 0's copy, as DeepSpeed.
"""
from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...core.errors import CheckpointError
from . import parallel, tensor_slices
from .constants import UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE
from .files import load_torch, write_torch
from .layout import model_states_name, zero_model_states_name
from .tp_merge import (AFFINE_MAP, MERGED_STATES, group_per_tp_shapes, merge_tp_slices, uc_info_from_shard_specs,
                       validate_autotp_conversion_support, vocab_rows)

SLICE_DIR = "tmp"  # under the output folder, removed when done (DeepSpeed's name)
FP32, STEP = "fp32", "step"


def _uc_info(ck, local_shapes: Dict[str, List[int]], tp: int, inject_missing_state: bool) -> Dict[str, Any]:
    model = ck.model_of(0)
    info = model.get(UNIVERSAL_CHECKPOINT_INFO)
    if info is None and "dslaunch" in model:
        specs = (model.get("dslaunch") or {}).get("tensor_parallel_shards") or {}
        info = uc_info_from_shard_specs(specs, local_shapes, tp)
    if info is None and inject_missing_state:
        info = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    if info is None:
        raise CheckpointError(f"checkpoint {ck.path} records no {UNIVERSAL_CHECKPOINT_INFO}, so its tensor-parallel "
                              "slices cannot be joined (DeepSpeed refuses it too); pass --inject_missing_state to "
                              "join every split parameter along dim 0")
    if not isinstance(info, dict):
        raise CheckpointError(f"checkpoint {ck.path}: {UNIVERSAL_CHECKPOINT_INFO} is not a dict")
    validate_autotp_conversion_support(info)
    return info


def _without_affine_map(info: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, List[int]]]:
    """DeepSpeed 0.19.8's AutoTP also publishes an affine map (each rank's pieces of each
    parameter) and keeps the category patterns beside it so that a converter which does not
    read the map still can: this one joins by the patterns, and holds each joined parameter
    to the map's logical shape (pattern -> shape)."""
    amap = info.get(AFFINE_MAP)
    if not amap:
        return info, {}
    params = amap.get("params") if isinstance(amap, dict) else None
    if not isinstance(params, dict):
        raise CheckpointError(f"{UNIVERSAL_CHECKPOINT_INFO}: its {AFFINE_MAP} has no params")
    shapes = {p: list(e.get("logical_shape") or []) for p, e in params.items() if isinstance(e, dict)}
    return {k: v for k, v in info.items() if k != AFFINE_MAP}, shapes


def _check_logical_shapes(zero: str, names, shapes: Dict[str, List[int]], path: str) -> None:
    for name in names:
        want = next((s for p, s in shapes.items() if re.match(p, name)), None)
        fpath = os.path.join(zero, *name.split("/"), FP32 + ".pt")
        if want is None or not os.path.isfile(fpath):
            continue
        got = list(load_torch(fpath)["param"].shape)
        if got != want:
            raise CheckpointError(f"checkpoint {path}: {name} joined by its patterns has shape {got}, its affine "
                                  f"map's logical shape is {want}; the patterns and the map disagree")


def _write_slice(folder: str, tp: int, name: str, entry: Dict[str, Any]) -> None:
    """One tensor rank's whole (over data ranks) state of one parameter, as the single
    data-rank fragment <state>.00 of DeepSpeed's slice folder."""
    base = os.path.join(folder, name, str(tp))
    os.makedirs(base, exist_ok=True)
    for key, value in entry.items():
        write_torch(os.path.join(base, f"{key}.00"), value.reshape(-1).clone() if torch.is_tensor(value) and
                    key != STEP else value, checksum=False)


def convert_tensor_parallel(ck, output_folder: str, whole_of, extract_workers: int, merge_workers: int,
                            strict: bool, inject_missing_state: bool) -> Tuple[Dict[str, Dict[str, Any]], List[Any]]:
    """Write zero/<param>/ of the universal layout for tensor-parallel checkpoint `ck` into
    `output_folder` and every tensor rank's model states; returns (name -> {"step": ...} of
    the trained parameters, the saved param_groups). `whole_of(shards, workers)`: universal.py's
    per-parameter assembly of one tensor rank's data-parallel shards."""
    tp = int(ck.topology["model"])
    if int(ck.topology.get("pipe", 1)) > 1:
        raise CheckpointError(f"checkpoint {ck.path} has pipeline stages besides its {tp} tensor slices; converting "
                              "it to the universal layout is not supported")
    slices, hyper = [], None
    for s in range(tp):
        shards = parallel.slice_shards(ck, s)
        hyper = hyper or (shards[0].get("param_groups") if shards else None)
        slices.append(whole_of(shards, extract_workers))
    extra = sorted({k for per in slices for e in per.values() for k in e if k not in MERGED_STATES + (STEP,)})
    if extra:
        raise CheckpointError(f"checkpoint {ck.path}: optimizer state {', '.join(extra)} has no place in DeepSpeed's "
                              f"tensor-parallel universal layout, which carries {', '.join(MERGED_STATES[1:])} "
                              "(Adam's)")
    # a vocabulary split pads every rank to the same rows: only the real ones go to the slices
    specs = (ck.model_of(0).get("dslaunch") or {}).get("tensor_parallel_shards") or {}
    for s, per in enumerate(slices):
        for name, entry in per.items():
            rows = vocab_rows(specs.get(name), tp, s)
            if rows is not None:
                per[name] = {k: (v.narrow(0, 0, rows) if torch.is_tensor(v) and k != STEP and v.dim() else v)
                             for k, v in entry.items()}
    shapes = group_per_tp_shapes([{n: list(e[FP32].shape) for n, e in per.items()} for per in slices], 1, tp)
    missing = sorted(n for n, per_tp in shapes.items() if any(s is None for s in per_tp))
    if missing:
        raise CheckpointError(f"checkpoint {ck.path}: {missing[0]} is trained on some tensor ranks only")
    info = _uc_info(ck, {n: per_tp[0] for n, per_tp in shapes.items()}, tp, inject_missing_state)
    info, logical = _without_affine_map(info)
    zero = os.path.join(output_folder, "zero")
    tmp = os.path.join(output_folder, SLICE_DIR)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for s, per in enumerate(slices):
            for name, entry in per.items():
                _write_slice(tmp, s, name, entry)
        slices.clear()  # the slice folder holds them now
        with ThreadPoolExecutor(max_workers=merge_workers) as pool:
            unmatched = list(pool.map(lambda item: merge_tp_slices(info, zero, tmp, tp, item), sorted(shapes.items())))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    unused = sorted(set.intersection(*unmatched)) if unmatched else []
    if unused and strict:
        raise CheckpointError(f"checkpoint {ck.path}: universal_checkpoint_info patterns {unused} match no "
                              "parameter (pass --no_strict to convert anyway)")
    _check_logical_shapes(zero, shapes, logical, ck.path)
    # frozen parameters and buffers: from the module, made whole where the splits are recorded
    module = tensor_slices.module_state(ck, None, 1, 0)
    for name, value in module.items():
        fpath = os.path.join(zero, *name.split("/"), FP32 + ".pt")
        if name not in shapes and torch.is_tensor(value) and not os.path.isfile(fpath):
            os.makedirs(os.path.dirname(fpath), exist_ok=True)
            write_torch(fpath, {"param": value.detach().float().contiguous()}, checksum=False)
    steps: Dict[str, Dict[str, Any]] = {}
    for name in shapes:
        spath = os.path.join(zero, *name.split("/"), STEP + ".pt")
        if os.path.isfile(spath):
            steps[name] = {STEP: load_torch(spath)}
    for s in range(tp):
        model = {k: v for k, v in ck.model_of(s).items() if k != "dslaunch"}
        model.setdefault(UNIVERSAL_CHECKPOINT_INFO, info)
        names = [model_states_name(s)] + ([zero_model_states_name(0, s)] if ck.zero_stage == 3 else [])
        for fname in names:
            write_torch(os.path.join(output_folder, fname), model, deepspeed_objects=True, checksum=False)
    return steps, hyper


__all__ = ["convert_tensor_parallel"]
