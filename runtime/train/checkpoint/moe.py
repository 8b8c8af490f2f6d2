"""MoE checkpoints in DeepSpeed's layout, and reading them back at any expert-parallel size.

A model with MoE layers (runtime/moe/) saves as DeepSpeed's _save_moe_checkpoint does:

  layer_{L}_expert_{E}_mp_rank_00_model_states.pt
        one file per expert of the L-th MoE layer (in named_modules order), numbered by
        global expert id E = expert-parallel rank x local experts + local id, its keys
        under that global id; written by the first rank of each expert-data-parallel group;
  expp_rank_{R}_mp_rank_00_optim_states.pt
        ZeRO 0: expert-parallel rank R's whole optimizer state (its own experts and the
        dense parameters), {"optimizer": ...}, plus dslaunch's parameter names; ZeRO 1/2
        keep the usual zero_pp_rank files instead (DeepSpeed 0.19 writes no expp file
        there), their "moe" groups partitioned over the expert-data-parallel group;
  mp_rank_00_model_states.pt
        everything else: the module without expert weights, "num_experts" per layer.

Resuming at another expert-parallel size (or world size) goes through global expert ids:
every saved expert file and every saved optimizer state (each expp file, or each ZeRO
shard, whose expert-parallel rank is its data-parallel rank mod the saved ep) is renamed
from its saver's local expert ids to global ones, then to this rank's local ids, keeping
only its own experts. The optimizer state then reaches the strategy as name-keyed shards
(reshard.py), which stage 0, 1 and 2 already re-cut for their own partition.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .run import Run
from ...core.errors import CheckpointError
from ...moe.layer import MoE
from ...zero.reshard import shards_from_stage0
from .dsformat import stage0_from_ds

EXPERTS = ".deepspeed_moe.experts.deepspeed_experts."
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
_EXPP_FILE = re.compile(r"expp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_KEY = re.compile(r"(.*)" + re.escape(EXPERTS) + r"(\d+)\.(.*)")


def expert_file_name(layer: int, expert: int) -> str:
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def expp_file_name(ep_rank: int) -> str:
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


def moe_layers(module: torch.nn.Module) -> List[Tuple[str, Any]]:
    """(name, layer) of every MoE layer, in DeepSpeed's numbering order."""
    return [(n, m) for n, m in module.named_modules() if isinstance(m, MoE)]


def uses_layout(module: torch.nn.Module, layout) -> bool:
    """Whether a model saves in the MoE layout: it has MoE layers and its shard layout keeps
    DeepSpeed's per-expert files (ZeRO-3's does not: it takes MoE only at ep_size 1, where
    every rank holds every expert, and saves as any model; DeepSpeed refuses MoE with
    ZeRO-3, so it has no MoE layout to follow there)."""
    return layout.expert_files and bool(moe_layers(module))


def is_expert_key(name: str) -> bool:
    return _KEY.fullmatch(name) is not None


# -- saving ----------------------------------------------------------------------------------------
def expert_files(module: torch.nn.Module, module_state: Dict[str, torch.Tensor], ep_rank: int
                 ) -> Dict[str, Dict[str, torch.Tensor]]:
    """This expert-parallel rank's expert files: name -> that expert's weights under its global id."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for index, (prefix, layer) in enumerate(moe_layers(module)):
        if not prefix:
            raise CheckpointError("save_checkpoint: the model itself is an MoE layer; wrap it in a module so its "
                                  "expert weights have DeepSpeed's names (<layer>.deepspeed_moe.experts...)")
        local = layer.num_local_experts
        head = f"{prefix}{EXPERTS}"
        for e in range(local):
            g = ep_rank * local + e
            own = f"{head}{e}."
            out[expert_file_name(index, g)] = {f"{head}{g}.{k[len(own):]}": v.detach().clone()
                                               for k, v in module_state.items() if k.startswith(own)}
    return out


def without_experts(module_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return type(module_state)((k, v) for k, v in module_state.items() if not is_expert_key(k))


# -- reading ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SavedExperts:
    """What a checkpoint says about its MoE layers."""

    files: Dict[int, Dict[int, str]]  # layer index -> global expert id -> file
    num_experts: List[int]  # per layer
    ep_size: int


def file_names(ck) -> List[str]:
    return sorted(ck.manifest.files) if ck.manifest is not None else sorted(os.listdir(ck.path))


def saved_experts(ck) -> Optional[SavedExperts]:
    """None when the checkpoint has no expert files (no MoE layers)."""
    names = file_names(ck)
    files: Dict[int, Dict[int, str]] = {}
    for n in names:
        m = _EXPERT_FILE.fullmatch(n)
        if m:
            files.setdefault(int(m.group(1)), {})[int(m.group(2))] = n
    if not files:
        return None
    num = ck.model.get("num_experts")
    if not isinstance(num, list) or len(num) != len(files):
        num = [len(files[i]) for i in sorted(files)]
    for i, n in enumerate(num):
        if sorted(files.get(i, {})) != list(range(int(n))):
            raise CheckpointError(f"checkpoint {ck.path}: MoE layer {i} has {n} experts but expert files "
                                  f"{sorted(files.get(i, {}))} (a file is missing)")
    expp = [n for n in names if _EXPP_FILE.fullmatch(n)]
    if not ck.sharded:
        ep = len(expp)
        if ep == 0:
            raise CheckpointError(f"checkpoint {ck.path}: MoE expert files but no expp_rank optimizer files")
    else:
        ep = _ep_from_shapes(ck, [int(n) for n in num])
    return SavedExperts(files, [int(n) for n in num], ep)


def _ep_from_shapes(ck, num) -> int:
    """ZeRO 1/2: the saved ep from how many local experts the saved parameter names count."""
    local = 0
    for group in ck.param_shapes():
        for name in group:
            m = _KEY.fullmatch(name)
            if m:
                local = max(local, int(m.group(2)) + 1)
    if local == 0 or num[0] % local:
        raise CheckpointError(f"checkpoint {ck.path}: its optimizer state names no expert parameters")
    return num[0] // local


def global_module_state(ck, saved: SavedExperts) -> Dict[str, torch.Tensor]:
    """Every weight under its global name: the dense module plus every expert file."""
    out = dict(ck.module_state())
    for layer in sorted(saved.files):
        for g in sorted(saved.files[layer]):
            out.update(ck.read(saved.files[layer][g]))
    return out


def renamer(num_experts: Dict[str, int], ep_size: int, ep_rank: int, to_global: bool
            ) -> Callable[[str], Optional[str]]:
    """Local <-> global expert names for expert-parallel rank `ep_rank` of `ep_size`;
    num_experts: layer prefix -> its experts. to_global=False drops other ranks' experts."""
    def rename(name: str) -> Optional[str]:
        m = _KEY.fullmatch(name)
        if m is None:
            return name
        prefix, idx, rest = m.group(1), int(m.group(2)), m.group(3)
        local = num_experts[prefix] // ep_size
        if to_global:
            idx = ep_rank * local + idx
        else:
            if not ep_rank * local <= idx < (ep_rank + 1) * local:
                return None
            idx -= ep_rank * local
        return f"{prefix}{EXPERTS}{idx}.{rest}"

    return rename


def rename_state(state: Dict[str, torch.Tensor], rename) -> Dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        new = rename(k)
        if new is not None:
            out[new] = v
    return out


def rename_shards(shards: List[Dict[str, Any]], rename) -> List[Dict[str, Any]]:
    """Each shard's names through `rename` (None drops the parameter)."""
    out = []
    for sh in shards:
        groups = []
        for g in sh["groups"]:
            pieces = []
            for p in g["pieces"]:
                new = rename(p["name"])
                if new is not None:
                    pieces.append(dict(p, name=new))
            groups.append({"pieces": pieces, "shapes": rename_state(g["shapes"], rename),
                           "master": rename_state(g["master"], rename),
                           "state": {k: (rename_state(v, rename) if isinstance(v, dict) else v)
                                     for k, v in g["state"].items()}})
        out.append(dict(sh, groups=groups))
    return out


def read_expp_state(ck, name: str) -> Tuple[Dict[str, Any], Optional[List[List[str]]]]:
    """An expp optimizer file's stage-0 state and its param groups' parameter names (None: a
    DeepSpeed file, which records none; given, they also name the state's fp32 masters)."""
    f = ck.read(name)
    if not isinstance(f, dict):
        raise CheckpointError(f"checkpoint {ck.path}: {name} is not an optimizer-states dict")
    try:
        state = stage0_from_ds(f.get("optimizer"))
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {ck.path}: {name} {exc}") from None
    names = (f.get("dslaunch") or {}).get("param_names")
    if names is not None:
        state["master_names"] = [n for group in names for n in group]
    return state, names


def global_shards(ck, saved: SavedExperts, full: Dict[str, torch.Tensor],
                  group_names: Optional[Callable[[int, int], List[List[str]]]] = None) -> List[Dict[str, Any]]:
    """Every saved optimizer state as name-keyed shards under global expert names.
    group_names(ep_rank, local): each param group's names for a DeepSpeed expp file (which
    records none)."""
    num = _num_by_prefix(full, saved, ck.path)
    shards: List[Dict[str, Any]] = []
    if ck.sharded:
        for d in range(ck.world_size):
            r = d % saved.ep_size  # expert-parallel groups are runs of ep consecutive ranks
            shards += rename_shards([ck.shard(d, 0, mmap=True)], renamer(num, saved.ep_size, r, True))
        return shards
    for r in range(saved.ep_size):
        name = expp_file_name(r)
        state, names = read_expp_state(ck, name)
        if names is None:
            if group_names is None:
                raise CheckpointError(f"checkpoint {ck.path}: {name} names no parameters")
            names = group_names(r, saved.ep_size)
        to_global = renamer(num, saved.ep_size, r, True)
        own = rename_state(full, renamer(num, saved.ep_size, r, False))
        shards += rename_shards(shards_from_stage0(state, names, own), to_global)
    return shards


def _num_by_prefix(full: Dict[str, torch.Tensor], saved: SavedExperts, path: str = "") -> Dict[str, int]:
    """Layer prefix -> its number of experts (prefixes in DeepSpeed's layer order)."""
    order: List[str] = []
    for k in full:
        m = _KEY.fullmatch(k)
        if m and m.group(1) not in order:
            order.append(m.group(1))
    if len(order) != len(saved.num_experts):
        raise CheckpointError(f"checkpoint {path}: {len(saved.num_experts)} MoE layers saved but expert weights under "
                              f"{len(order)} prefixes")
    return dict(zip(order, saved.num_experts))


# -- loading into an engine ------------------------------------------------------------------------
def _engine_renamer(ck, run: Run, saved: SavedExperts, full):
    layers = moe_layers(run.module)
    if len(layers) != len(saved.num_experts) or any(
            l.num_experts != n for (_, l), n in zip(layers, saved.num_experts)):
        raise CheckpointError(f"checkpoint {ck.path}: its MoE layers have {saved.num_experts} experts, this model's "
                              f"{[l.num_experts for _, l in layers]}")
    ep = layers[0][1].ep_size
    return renamer(_num_by_prefix(full, saved, ck.path), ep, run.expert_rank if ep > 1 else 0, False)


def module_state(ck, run: Run, saved: SavedExperts) -> Dict[str, torch.Tensor]:
    """This rank's module state: the dense weights and its own experts under local ids."""
    full = global_module_state(ck, saved)
    return rename_state(full, _engine_renamer(ck, run, saved, full))


def _ds_group_names(run: Run) -> Callable[[int, int], List[List[str]]]:
    """The names of a DeepSpeed expp file's param groups, which it records none of: this
    engine's groups, each layer's expert parameters re-listed for the saving rank's local
    experts (module order, as DeepSpeed's moe param groups list them)."""
    strategy = run.strategy
    names = getattr(strategy, "_group_names", None) or getattr(strategy, "listed_names", None) or []
    experts_of = {prefix: layer.num_experts for prefix, layer in moe_layers(run.module)}

    def for_rank(r: int, ep: int) -> List[List[str]]:
        out = []
        for group in names:
            listed, done = [], set()
            for n in group:
                m = _KEY.fullmatch(n)
                if m is None:
                    listed.append(n)
                    continue
                prefix = m.group(1)
                if prefix in done:
                    continue
                done.add(prefix)
                tails = [k.group(3) for k in map(_KEY.fullmatch, group)
                         if k is not None and k.group(1) == prefix and k.group(2) == "0"]
                listed += [f"{prefix}{EXPERTS}{e}.{t}" for e in range(experts_of[prefix] // ep) for t in tails]
            out.append(listed)
        return out

    return for_rank


def optimizer_shards(ck, run: Run, saved: SavedExperts) -> List[Dict[str, Any]]:
    """This rank's optimizer state as name-keyed shards under its local expert names."""
    full = global_module_state(ck, saved)
    shards = global_shards(ck, saved, full, _ds_group_names(run))
    return rename_shards(shards, _engine_renamer(ck, run, saved, full))
