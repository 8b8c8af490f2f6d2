"""AutoEP checkpoints in DeepSpeed 0.19.8's layout (its _save_moe_checkpoint for AutoEP layers).

An AutoEP layer (runtime/moe/autoep) holds its rank's experts stacked: `<layer>.experts.w1`,
`w2`, `w3`, each [local experts, out, in]. Saved as DeepSpeed saves them:

  layer_{L}_expert_{E}_mp_rank_00_model_states.pt
        one file per expert of the L-th AutoEP layer (named_modules order), E the global
        expert id (expert-parallel rank x local experts + local id), holding that expert's
        three 2-D matrices under `<layer>.experts.w1.{E}` (w2, w3 alike); written by the first
        rank of each expert-data-parallel group;
  expp_rank_{R}_mp_rank_00_optim_states.pt
        ZeRO 0: expert-parallel rank R's whole optimizer state (moe.py writes it);
        ZeRO 1/2: the usual zero_pp_rank files, "moe" groups partitioned over the
        expert-data-parallel group;
  mp_rank_00_model_states.pt
        the module without the stacked expert weights, "num_experts" per layer and
        "ds_autoep_layers": a record per layer (DeepSpeed's fields: its id, module path,
        experts, local experts, ep size, the contiguous expert placement, the expert key
        prefix, "per_expert_files"), also under universal_checkpoint_info with the expert
        parameter pattern.

Loading rebuilds this rank's stacked experts from the per-expert files, so the weights load
at any autoep_size. The optimizer state is the saving ranks' local experts' state: it loads
at the autoep_size and world size that saved it (ZeRO 0: this rank's expp file, which only
needs the same autoep_size); elsewhere one line says so (load_optimizer_states=False loads the
weights alone). DeepSpeed 0.19.8 reaches another expert-parallel size through its
universal-checkpoint conversion for AutoEP, which is not built here.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .run import Run
from ...core.errors import CheckpointError
from ...moe.autoep.layer import AutoEPMoELayer
from .moe import expert_file_name, expp_file_name, read_expp_state

WEIGHTS = ("w1", "w2", "w3")
LAYERS_KEY = "ds_autoep_layers"
FORMAT = "per_expert_files"
EXPERT_PATTERN = r".*\.experts\.w[123]$"  # DeepSpeed's expert_parameter_patterns entry for AutoEP


def layers(module: torch.nn.Module) -> List[Tuple[str, AutoEPMoELayer]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]


def uses_layout(module: torch.nn.Module) -> bool:
    """AutoEP runs at ZeRO 0-2 only (attach.py refuses stage 3)."""
    return bool(layers(module))


def _prefix(name: str) -> str:
    return f"{name}.experts" if name else "experts"


def expert_keys(module: torch.nn.Module) -> List[str]:
    return [f"{_prefix(n)}.{w}" for n, _ in layers(module) for w in WEIGHTS]


def without_experts(module_state: Dict[str, torch.Tensor], module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    drop = set(expert_keys(module))
    return type(module_state)((k, v) for k, v in module_state.items() if k not in drop)


def placement(num_experts: int, ep_size: int) -> Dict[str, Any]:
    """DeepSpeed's placement descriptor for contiguous experts: rank r holds r*local ... ."""
    local = num_experts // ep_size
    return {"version": 1, "num_experts": num_experts, "ep_size": ep_size,
            "ranks": [{"rank": r, "experts": list(range(r * local, (r + 1) * local))} for r in range(ep_size)]}


def layer_records(module: torch.nn.Module, edp_rank: int, edp_size: int) -> List[Dict[str, Any]]:
    out = []
    for index, (name, layer) in enumerate(layers(module)):
        local = layer.num_local_experts
        out.append({"moe_layer_id": index, "module_path": name, "num_experts": layer.num_experts,
                    "num_local_experts": local, "ep_size": layer.ep_size,
                    "expert_placement": placement(layer.num_experts, layer.ep_size),
                    "expert_key_prefix": _prefix(name), "checkpoint_format": FORMAT,
                    "checkpoint_format_version": None, "ep_group_name": layer.ep_group_name,
                    "ep_rank": layer.ep_rank, "expert_data_parallel_rank": edp_rank,
                    "expert_data_parallel_world_size": edp_size, "global_expert_start": layer.ep_rank * local,
                    "global_expert_end": (layer.ep_rank + 1) * local})
    return out


def expert_files(module: torch.nn.Module) -> Dict[str, Dict[str, torch.Tensor]]:
    """This rank's expert files: file name -> that expert's matrices under its global id."""
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    for index, (name, layer) in enumerate(layers(module)):
        local = layer.num_local_experts
        for e in range(local):
            g = layer.ep_rank * local + e
            out[expert_file_name(index, g)] = {f"{_prefix(name)}.{w}.{g}": getattr(layer.experts, w)[e].detach().clone()
                                               for w in WEIGHTS}
    return out


# -- reading ---------------------------------------------------------------------------------------
def saved_layers(ck) -> Optional[List[Dict[str, Any]]]:
    """The checkpoint's AutoEP layer records (None: saved without AutoEP layers)."""
    records = ck.model.get(LAYERS_KEY)
    if records is None:
        return None
    if not isinstance(records, list) or not all(isinstance(r, dict) and "expert_key_prefix" in r and "num_experts" in r
                                                and "ep_size" in r for r in records):
        raise CheckpointError(f"checkpoint {ck.path} is damaged: its {LAYERS_KEY} is not a list of layer records")
    return records


def saved_ep_size(records: List[Dict[str, Any]]) -> int:
    return int(records[0]["ep_size"]) if records else 1


def check_model(ck, run: Run, records: List[Dict[str, Any]]) -> None:
    own = layers(run.module)
    theirs = [(r["expert_key_prefix"], int(r["num_experts"])) for r in records]
    mine = [(_prefix(n), m.num_experts) for n, m in own]
    if theirs != mine:
        raise CheckpointError(f"checkpoint {ck.path}: its AutoEP layers (prefix, experts) are {theirs[:3]}"
                              f"{' ...' if len(theirs) > 3 else ''}, this model's {mine[:3]}"
                              f"{' ...' if len(mine) > 3 else ''}")


def module_state(ck, run: Run, records: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """The dense weights and this rank's experts, stacked from their per-expert files."""
    check_model(ck, run, records)
    names = set(ck.manifest.files) if ck.manifest is not None else None
    out = dict(ck.module_state())
    for index, (name, layer) in enumerate(layers(run.module)):
        local = layer.num_local_experts
        rows: Dict[str, List[torch.Tensor]] = {w: [] for w in WEIGHTS}
        for e in range(local):
            g = layer.ep_rank * local + e
            fname = expert_file_name(index, g)
            if names is not None and fname not in names:
                raise CheckpointError(f"checkpoint {ck.path}: expert file {fname} is missing (AutoEP layer "
                                      f"'{name}', expert {g})")
            part = ck.read(fname)
            for w in WEIGHTS:
                key = f"{_prefix(name)}.{w}.{g}"
                t = part.get(key) if isinstance(part, dict) else None
                if not torch.is_tensor(t) or t.dim() != 2:
                    raise CheckpointError(f"checkpoint {ck.path} is damaged: {fname} has no 2-D {key}")
                rows[w].append(t)
        for w in WEIGHTS:
            out[f"{_prefix(name)}.{w}"] = torch.stack(rows[w])
    return out


def check_optimizer_layout(ck, run: Run, records: List[Dict[str, Any]], same_layout: bool) -> None:
    """The saved optimizer state holds the saving ranks' local experts: it fits this job only
    at the same autoep_size (and, ZeRO 1/2, the same data-parallel layout)."""
    saved, ep = saved_ep_size(records), run.expert_parallel_size
    if saved != ep:
        raise CheckpointError(f"checkpoint {ck.path} was saved at expert_parallel.autoep_size {saved} and this job "
                              f"runs {ep}: its optimizer state holds each rank's own experts and is not re-cut here; "
                              "load with load_optimizer_states=False (the weights load at any autoep_size)")
    if ck.sharded and not same_layout:
        raise CheckpointError(f"checkpoint {ck.path} was saved at topology {ck.topology} and this job runs another; "
                              "an AutoEP model's ZeRO optimizer state is not re-cut here (load with "
                              "load_optimizer_states=False)")


def stage0_state(ck, run: Run) -> Dict[str, Any]:
    """ZeRO 0: this expert-parallel rank's optimizer state, from its expp file."""
    ep = run.expert_parallel_size
    name = expp_file_name(run.expert_rank if ep > 1 else 0)
    if ck.manifest is not None and name not in ck.manifest.files:
        raise CheckpointError(f"checkpoint {ck.path}: {name} is missing (the optimizer state of this rank's experts)")
    state, names = read_expp_state(ck, name)
    if names is not None:
        state["param_names"] = names
    return state


__all__ = ["EXPERT_PATTERN", "FORMAT", "LAYERS_KEY", "check_optimizer_layout", "expert_file_name", "expert_files",
           "expert_keys", "layer_records", "layers", "module_state", "saved_layers", "uses_layout", "without_experts"]
