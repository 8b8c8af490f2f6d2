"""DeepSpeed's universal checkpoints: read (`"checkpoint": {"load_universal": true}`) and
written (`ds_to_universal`) without DeepSpeed.

DeepSpeed cannot re-cut a ZeRO checkpoint for another world size, so its users convert one
to a layout that holds every parameter whole (deepspeed/checkpoint/ds_to_universal.py,
0.19.8) and load that with load_universal. dslaunch's own checkpoints re-shard on load;
this module lets a DeepSpeed user bring a universal folder here, and take a checkpoint
(ours or DeepSpeed's) back to DeepSpeed at another topology:

    SAVE_DIR/latest_universal           the universal folder's name (DeepSpeed reads it when tag=None)
    SAVE_DIR/TAG/                       the converter's --output_folder
      mp_rank_00_model_states.pt        the source's model states: scheduler, counters, client state
      zero_pp_rank_0_mp_rank_00_model_states.pt   the same, under the name DeepSpeed's ZeRO-3 looks for
      zero/optimizer_state.pt           the ZeRO optimizer's global state (loss scaler, clip_grad,
                                        ds_version) and param_groups
      zero/<param>/fp32.pt              {"param": the whole fp32 weight, "cat_dim": 0}
      zero/<param>/<state>.pt           each optimizer state tensor, in the same form
      zero/<param>/step.pt              the step count as the optimizer kept it (int or tensor)

DeepSpeed's converter writes the model-states files under the source stage's name only,
ZeRO-3's weights flat, and ZeRO-3's step inside optimizer_state.pt (not step.pt); both forms
are read here. Written here, a folder carries both model-states names, shaped tensors, step.pt
and the optimizer_state.pt fields both of DeepSpeed's loaders read, so DeepSpeed loads it at
any ZeRO stage (1-3) and world size. Buffers get a fp32.pt too, as DeepSpeed's converter
writes them (DeepSpeed's universal loading does not restore buffers; ours takes them from the
model states).

Tensor-parallel checkpoints are joined by their merge patterns (universal_tp.py). Not
covered (one line each): pipeline checkpoints and DeepSpeed's stage-0 checkpoints (no
parameter names; DeepSpeed's converter refuses them too). Every file is read with weights_only=True.
"""
from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .constants import UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE
from .dsformat import DS_KEYS, DS_VERSION, loss_scaler_from_ds, shape_problem
from ...core.errors import CheckpointError
from .files import load_torch, os_error, write_torch
from .foreign import loss_scaler_record
from .layout import model_states_name, zero_model_states_name
from ...zero.reshard import assemble

LATEST_UNIVERSAL = "latest_universal"
ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
FP32, STEP = "fp32", "step"
# the per-rank pieces DeepSpeed's optimizer states carry; a universal folder keeps them per parameter
_SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups",
                 "fp32_flat_groups", "optimizer_state_dict")


def is_universal(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ZERO_DIR, OPTIMIZER_STATE))


# -- reading -----------------------------------------------------------------------------------
@dataclass
class UniversalCheckpoint:
    path: str
    model: Dict[str, Any]              # the model-states file: counters, scheduler, client state, buffers
    optim: Dict[str, Any]              # zero/optimizer_state.pt
    params: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # name -> {"fp32": t, "exp_avg": t, "step": v}

    @property
    def step(self) -> Any:
        """The step count every parameter's state shares (stage 1-2 folders: step.pt; ZeRO-3's:
        optimizer_state.pt). DeepSpeed's optimizers count per param group and its loader
        requires them equal; the largest is taken when they are not (a fused optimizer's
        last-stepped count)."""
        steps = [p[STEP] for p in self.params.values() if STEP in p]
        if not steps:
            state = (self.optim.get("optimizer_state_dict") or {}).get("state") or {}
            first = state.get(0) if isinstance(state, dict) else None
            return first.get(STEP) if isinstance(first, dict) else None
        return max(steps, key=lambda v: float(v))

    def param_groups(self) -> List[Dict[str, Any]]:
        groups = self.optim.get("param_groups")
        if not isinstance(groups, list):
            groups = (self.optim.get("optimizer_state_dict") or {}).get("param_groups")
        if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(f"universal checkpoint {self.path}: {ZERO_DIR}/{OPTIMIZER_STATE} has no param_groups")
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def module_state(self) -> Dict[str, torch.Tensor]:
        """The saved module with every trained weight taken from its fp32.pt, in the dtype the
        module states hold it (DeepSpeed restores weights from fp32.pt; ZeRO-3's module states
        hold empty placeholders). Buffers and frozen weights stay as the module states hold
        them (an integer buffer would not survive DeepSpeed's fp32 copy)."""
        module = self.model.get("module")
        module = dict(module) if isinstance(module, dict) else {}
        for name, p in self.params.items():
            old = module.get(name)
            if not torch.is_tensor(old):
                module[name] = p[FP32]
            elif len(p) > 1 or old.numel() != p[FP32].numel():
                module[name] = p[FP32].to(old.dtype)
        for alias, canon in (self.model.get("shared_params") or {}).items():
            if canon in module:
                module[alias] = module[canon]
        return module

    def shard(self) -> Dict[str, Any]:
        """The optimizer state as one name-keyed shard (reshard.py's form) holding every
        parameter whole, which every ZeRO stage and stage 0 re-cut for their own layout. Group 0
        holds the tensors; each saved param group carries the shared step (a strategy reads a
        group's scalars by its index) and the shard its hyperparameters."""
        hyper = self.param_groups()
        group0: Dict[str, Any] = {"pieces": [], "shapes": {}, "master": {}, "state": {}}
        keys = sorted({k for p in self.params.values() for k in p if k not in (FP32, STEP)})
        for name, p in self.params.items():  # buffers too (DeepSpeed writes their fp32.pt): re-cutting
            t = p[FP32]                          # looks up the trainable names only
            group0["pieces"].append({"name": name, "start": 0, "end": t.numel(), "offset": 0})
            group0["shapes"][name] = list(t.shape)
            group0["master"][name] = t.reshape(-1).float()
            for k in keys:
                if k in p:
                    group0["state"].setdefault(k, {})[name] = p[k].reshape(-1).float()
        step = self.step
        groups = []
        for gi in range(max(1, len(hyper))):
            g = group0 if gi == 0 else {"pieces": [], "shapes": {}, "master": {}, "state": {k: {} for k in keys}}
            if step is not None and keys:
                g["state"][STEP] = step
            groups.append(g)
        return {"format": "dslaunch-zero-shard/1", "stage": 0, "world_size": 1, "rank": 0, "groups": groups,
                "param_groups": hyper}

    def counters(self, gradient_accumulation_steps: int) -> Dict[str, int]:
        steps = int(self.model.get("global_steps", 0))
        return {"global_steps": steps, "micro_steps": steps * gradient_accumulation_steps,
                "global_samples": int(self.model.get("global_samples", 0)),
                "skipped_steps": int(self.model.get("skipped_steps", 0)), "dataloader_epoch": 0}

    def client_state(self) -> Dict[str, Any]:
        return {k: v for k, v in self.model.items() if k not in DS_KEYS}

    def loss_scaler_state(self) -> Optional[Dict[str, Any]]:
        return loss_scaler_from_ds(self.optim.get("loss_scaler"))


def _shapes_from(model: Dict[str, Any], path: str) -> Dict[str, List[int]]:
    """Only to reshape a tensor of exactly that many elements: nothing is sized from these."""
    out: Dict[str, List[int]] = {}
    for group in model.get("param_shapes") or []:
        if isinstance(group, dict):
            for n, s in group.items():
                problem = shape_problem(s)
                if problem:
                    raise CheckpointError(f"universal checkpoint {path}: param_shapes: {n} has shape {s}: {problem}")
                out[n] = list(s)
    return out


def _check_values(t: torch.Tensor, fpath: str, pname: str, key: str) -> None:
    """fp32 weights and optimizer moments are finite floating tensors: an integer tensor or
    a NaN/inf there would load and then poison every step after it, without a word."""
    if not t.is_floating_point():
        raise CheckpointError(f"universal checkpoint file {fpath}: {pname} {key} holds {str(t.dtype)[6:]}, where "
                              "a floating-point tensor belongs")
    bad = t.numel() - int(torch.isfinite(t).sum())
    if bad:
        raise CheckpointError(f"universal checkpoint file {fpath}: {pname} {key} holds {bad} NaN or infinite "
                              f"value(s) of {t.numel()}; refusing to load it")


def open_universal(path: str, trust_pickle: bool = False) -> UniversalCheckpoint:
    if not os.path.isdir(path):
        raise CheckpointError(f"universal checkpoint {path} does not exist")
    if not is_universal(path):
        raise CheckpointError(f"{path} is not a universal checkpoint (no {ZERO_DIR}/{OPTIMIZER_STATE}); convert "
                              "one with `dslaunch ds_to_universal`, or load it without checkpoint.load_universal")
    name = next((n for n in (model_states_name(), zero_model_states_name(0))
                 if os.path.isfile(os.path.join(path, n))), None)
    if name is None:
        raise CheckpointError(f"universal checkpoint {path} has no model-states file ({model_states_name()})")
    model = load_torch(os.path.join(path, name), trust_pickle=trust_pickle, within=path)
    optim = load_torch(os.path.join(path, ZERO_DIR, OPTIMIZER_STATE), trust_pickle=trust_pickle, within=path)
    if not isinstance(model, dict) or not isinstance(optim, dict):
        raise CheckpointError(f"universal checkpoint {path} is damaged: {name} or {OPTIMIZER_STATE} is not a dict")
    uc = UniversalCheckpoint(path, model, optim)
    shapes = _shapes_from(model, path)
    zero = os.path.join(path, ZERO_DIR)
    for root, dirs, files in sorted(os.walk(zero)):
        if FP32 + ".pt" not in files:
            continue
        pname = os.path.relpath(root, zero).replace(os.sep, "/")
        entry: Dict[str, Any] = {}
        for f in sorted(files):
            if not f.endswith(".pt"):
                continue
            fpath = os.path.join(root, f)
            value = load_torch(fpath, trust_pickle=trust_pickle, within=path)
            key = f[:-3]
            if key == STEP:
                entry[STEP] = value
                continue
            t = value.get("param") if isinstance(value, dict) else value
            t = t.detach() if torch.is_tensor(t) else t
            if not torch.is_tensor(t):
                raise CheckpointError(f"universal checkpoint file {fpath} holds no tensor")
            _check_values(t, fpath, pname, key)
            entry[key] = t
        full = entry[FP32]
        shape = shapes.get(pname)
        for key, t in list(entry.items()):
            if key == STEP or not torch.is_tensor(t):
                continue
            if shape is not None and t.numel() == int(torch.Size(shape).numel()):
                entry[key] = t.reshape(shape)  # ZeRO-3's converter writes flat tensors
            elif t.numel() != full.numel():
                raise CheckpointError(f"universal checkpoint {path}: {pname}/{key}.pt has {t.numel()} elements, "
                                      f"fp32.pt has {full.numel()}")
            else:
                entry[key] = t.reshape(entry[FP32].shape if key != FP32 else t.shape)
        uc.params[pname] = entry
    if not uc.params:
        raise CheckpointError(f"universal checkpoint {path} holds no parameters under {ZERO_DIR}/")
    return uc


# -- writing -----------------------------------------------------------------------------------
@dataclass
class Converted:
    output_folder: str
    params: int
    state_keys: List[str]
    source_stage: int
    source_world_size: int


def _whole(shards: List[Dict[str, Any]], workers: int = 1) -> Dict[str, Dict[str, Any]]:
    """name -> {"fp32": whole fp32 weight, <state>: whole tensor, "step": the raw count}."""
    shapes: Dict[str, List[int]] = {}
    keys: Dict[str, set] = {}
    steps: Dict[str, Any] = {}
    for sh in shards:
        for g in sh["groups"]:
            names = [p["name"] for p in g["pieces"]]
            shapes.update({n: list(s) for n, s in g["shapes"].items()})
            for k, v in g["state"].items():
                for n in names:
                    if isinstance(v, dict):
                        if n in v:
                            keys.setdefault(n, set()).add(k)
                    elif k == STEP:
                        steps[n] = v

    def one(name: str) -> Dict[str, Any]:
        shape = shapes[name]
        numel = int(torch.Size(shape).numel())
        entry = {FP32: torch.zeros(numel, dtype=torch.float32)}
        assemble(shards, 0, "master", [(name, 0, numel, 0)], entry[FP32])
        for k in sorted(keys.get(name, ())):
            entry[k] = torch.zeros(numel, dtype=torch.float32)
            assemble(shards, 0, ("state", k), [(name, 0, numel, 0)], entry[k])
        for k in list(entry):
            entry[k] = entry[k].view(shape)
        if name in steps and len(entry) > 1:
            entry[STEP] = steps[name]
        return entry

    # Each parameter is assembled from its own slices, so names are independent work.
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(shapes, pool.map(one, list(shapes))))


def _clip_of(ds_config: Optional[Dict[str, Any]]) -> float:
    """The gradient clipping a DeepSpeed config trained with: DeepSpeed's default (1.0) where it
    leaves the key out."""
    value = (ds_config or {}).get("gradient_clipping", 1.0)
    return float(1.0 if value is None else value)


def _global_state(ck, whole: Dict[str, Dict[str, Any]], hyper: List[Dict[str, Any]]) -> Dict[str, Any]:
    """zero/optimizer_state.pt: the ZeRO optimizer's own fields (rank 0's file, its per-rank
    pieces dropped), param_groups, and the stage-3 loader's optimizer_state_dict.state[0].step."""
    if ck.sharded:
        saved = ck.read(ck.optim_name(0)).get("optimizer_state_dict")
        if not isinstance(saved, dict):
            raise CheckpointError(f"checkpoint {ck.path}: {ck.optim_name(0)} holds no optimizer_state_dict")
        out = {k: v for k, v in saved.items() if k not in _SHARDED_KEYS}
    else:
        scaler = ck.loss_scaler_state()
        dynamic = None
        fp16 = (ck.model.get("ds_config") or {}).get("fp16") or {}
        if scaler and fp16.get("enabled") and not fp16.get("loss_scale"):
            dynamic = {"factor": 2.0, "window": int(fp16.get("loss_scale_window", 1000)),
                       "min_scale": float(fp16.get("min_loss_scale", 1)), "hysteresis": int(fp16.get("hysteresis", 2)),
                       "consecutive_hysteresis": bool(fp16.get("consecutive_hysteresis", False))}
        clip = _clip_of(ck.model.get("ds_config"))
        out = {"loss_scaler": loss_scaler_record(scaler, dynamic), "dynamic_loss_scale": dynamic is not None,
               "overflow": False, "clip_grad": clip, "zero_stage": 0, "partition_count": [1] * len(hyper)}
    out.setdefault("ds_version", DS_VERSION)
    out.setdefault("clip_grad", _clip_of(ck.model.get("ds_config")))
    groups = [dict(g, params=[i]) for i, g in enumerate(hyper)]
    out["param_groups"] = groups
    step = next((e[STEP] for e in whole.values() if STEP in e), None)
    out["optimizer_state_dict"] = {"state": {i: {STEP: step} for i in range(len(groups))} if step is not None else {},
                                   "param_groups": groups}
    return out


def _write_text(path: str, text: str) -> None:
    tmp = path + ".part"
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise os_error(path, exc) from None


def _check_convertible(ck) -> None:
    if ck.layers:
        raise CheckpointError(f"checkpoint {ck.path} is a pipeline's (one file per layer); converting pipeline "
                              "checkpoints to the universal layout is not supported")
    if not ck.sharded and "param_names" not in ck.stage0_state():
        raise CheckpointError(f"checkpoint {ck.path} is DeepSpeed's without ZeRO: it records no parameter names, so "
                              "its optimizer state cannot be matched to parameters (DeepSpeed's converter refuses "
                              "stage 0 too)")


def convert(input_folder: str, output_folder: str, extract_workers: int = 4, merge_workers: int = 2,
            inject_missing_state: bool = False, strict: bool = True) -> Converted:
    """Write the universal layout of the checkpoint in `input_folder` (a tag folder, or a
    save dir whose `latest` names one; dslaunch's or DeepSpeed's, any ZeRO stage and world
    size) into `output_folder`, and `latest_universal` beside it. `extract_workers` threads
    assemble whole parameters, `merge_workers` threads write their files;
    `inject_missing_state` adds universal_checkpoint_info to the output's model states when
    the source has none, as DeepSpeed's converter does. A tensor-parallel checkpoint's slices
    are joined by universal_tp.py; `strict` (DeepSpeed's, off with --no_strict) refuses its
    patterns that match no parameter, and has nothing to relax without tensor slices."""
    for flag, n in (("--num_extract_workers", extract_workers), ("--num_merge_workers", merge_workers)):
        if not isinstance(n, int) or n < 1:
            raise CheckpointError(f"{flag} must be a whole number >= 1, got {n!r}")
    from .consolidate import resolve_tag
    from .reader import open_checkpoint
    from . import parallel

    ck = open_checkpoint(resolve_tag(input_folder, None))
    _check_convertible(ck)
    real_in, real_out = os.path.realpath(ck.path), os.path.realpath(output_folder)
    if real_out == real_in:  # resolved: a link to the input is the input
        raise CheckpointError(f"--output_folder {output_folder} is the checkpoint being converted; choose another")
    if os.path.commonpath([real_in, real_out]) == real_in:
        raise CheckpointError(f"--output_folder {output_folder} is inside the checkpoint {ck.path} being converted; "
                              "choose a folder outside it")
    if int(ck.topology.get("model", 1)) > 1:
        return _convert_tensor_parallel(ck, output_folder, extract_workers, merge_workers, inject_missing_state,
                                        strict)
    if not strict:
        raise CheckpointError("--no_strict: it relaxes only the check of tensor-parallel merge patterns, and checkpoint "
                              f"{ck.path} has no tensor-parallel slices; drop the flag")
    shards = parallel.all_shards(ck)  # ZeRO files of every rank, or a stage-0 state cut by name
    whole = _whole(shards, extract_workers)
    hyper = shards[0].get("param_groups") if shards else None
    if not hyper:
        raise CheckpointError(f"checkpoint {ck.path} records no optimizer param_groups; it cannot be converted")
    module = ck.module_state()
    model = {k: v for k, v in ck.model.items() if k != "dslaunch"}
    dtypes = {k: v.dtype for k, v in (ck.model.get("module") or {}).items() if torch.is_tensor(v)}
    model["module"] = {k: (whole[k][FP32].to(dtypes.get(k, torch.float32)) if k in whole else v)
                       for k, v in module.items()}
    for name, value in module.items():  # buffers and frozen weights, as DeepSpeed's converter writes them
        if name not in whole and torch.is_tensor(value):
            whole[name] = {FP32: value.detach().float()}
    _prepare_output(output_folder)
    zero = os.path.join(output_folder, ZERO_DIR)

    def write_param(item) -> None:
        name, entry = item
        folder = os.path.join(zero, *name.split("/"))
        os.makedirs(folder, exist_ok=True)
        for key, value in entry.items():
            obj = value if key == STEP else {"param": value.detach().clone().contiguous(), "cat_dim": 0}
            write_torch(os.path.join(folder, key + ".pt"), obj, checksum=False)

    with ThreadPoolExecutor(max_workers=merge_workers) as pool:
        list(pool.map(write_param, whole.items()))  # list(): a failed write raises here
    if inject_missing_state and UNIVERSAL_CHECKPOINT_INFO not in model:
        model[UNIVERSAL_CHECKPOINT_INFO] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}
    write_torch(os.path.join(zero, OPTIMIZER_STATE), _global_state(ck, whole, hyper), deepspeed_objects=True,
                checksum=False)
    for fname in (model_states_name(), zero_model_states_name(0)):
        write_torch(os.path.join(output_folder, fname), model, deepspeed_objects=True, checksum=False)
    root, leaf = os.path.split(os.path.abspath(output_folder))
    _write_text(os.path.join(root, LATEST_UNIVERSAL), leaf)
    keys = sorted({k for e in whole.values() for k in e if k not in (FP32, STEP)})
    return Converted(output_folder, sum(1 for e in whole.values() if len(e) > 1), keys, ck.zero_stage,
                     ck.world_size)


def _convert_tensor_parallel(ck, output_folder: str, extract_workers: int, merge_workers: int,
                             inject_missing_state: bool, strict: bool) -> Converted:
    from .universal_tp import convert_tensor_parallel

    _prepare_output(output_folder)
    steps, hyper = convert_tensor_parallel(ck, output_folder, _whole, extract_workers, merge_workers, strict,
                                           inject_missing_state)
    if not hyper:
        raise CheckpointError(f"checkpoint {ck.path} records no optimizer param_groups; it cannot be converted")
    zero = os.path.join(output_folder, ZERO_DIR)
    write_torch(os.path.join(zero, OPTIMIZER_STATE), _global_state(ck, steps, hyper), deepspeed_objects=True,
                checksum=False)
    root, leaf = os.path.split(os.path.abspath(output_folder))
    _write_text(os.path.join(root, LATEST_UNIVERSAL), leaf)
    return Converted(output_folder, len(steps), [k for k in ("exp_avg", "exp_avg_sq")], ck.zero_stage,
                     ck.world_size * int(ck.topology["model"]))


def _prepare_output(output_folder: str) -> None:
    try:
        if os.path.exists(output_folder):
            shutil.rmtree(os.path.join(output_folder, ZERO_DIR), ignore_errors=True)
        os.makedirs(os.path.join(output_folder, ZERO_DIR), exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {output_folder}: {exc.strerror or exc}") from None


__all__ = ["LATEST_UNIVERSAL", "Converted", "UniversalCheckpoint", "convert", "is_universal", "open_universal"]
