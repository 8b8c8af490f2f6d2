"""Checkpoints over a process topology: who writes which file, and reading a checkpoint
saved at another topology (pipeline depth, data-parallel size, with or without a pipeline).

Saving (DeepSpeed's layout, layout.py names):
  - every rank: its RNG state; its optimizer shard `zero_pp_rank_<dp>_mp_rank_<slice>` when
    the strategy shards it;
  - the first data-parallel rank of each (pipe, model) slice: `mp_rank_<slice>_model_states.pt`
    (scheduler, loss scaler, counters, the optimizer when not sharded); without a pipeline
    it also holds the module, with one it holds None and each of the stage's layers goes to
    `layer_<idx>-model_states.pt` (the layer's own state_dict, as DeepSpeed writes it);
  - the manifest records the topology and, for pipelines, which state_dict prefix each
    layer file fills ("3" for layer 3, "tied_modules.embed" for a tied layer).

Files are DeepSpeed's (dsformat.py); reading goes through reader.Checkpoint. Loading at
the same topology reads this rank's own files. At another one (pp=2 x dp=2 saved,
pp=1 x dp=2 or pp=4 x dp=1 resumed, or a model without a pipeline), the module state is
rebuilt from the layer files by global layer index, and the optimizer state from every
saved shard (or every stage's unsharded state, re-cut by parameter name), which each
strategy already knows how to re-cut for its own partition. Parameter names of a
PipelineModule do not depend on where stages are cut; a model without a pipeline is matched
through its `to_layers()` (each layer module's name in the model).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ...core.errors import CheckpointError
from ...pipe.module import PipelineError, PipelineModule, to_layers_prefixes
from ...zero.reshard import shards_from_stage0
from . import tensor_slices
from .layout import layer_states_name, model_states_name, optim_states_name, zero_model_states_name
from .run import Run


def _pipeline_module(run: Run):
    return run.module if isinstance(run.module, PipelineModule) else None


def is_pipeline(run: Run) -> bool:
    return _pipeline_module(run) is not None


# -- saving ----------------------------------------------------------------------------------------
def manifest_fields(run: Run) -> Dict[str, Any]:
    """What the manifest records about the layout (any rank computes the same)."""
    pipe = _pipeline_module(run)
    p = run.place
    layers = {}
    if pipe is not None:
        layers = {layer_states_name(idx, p.mp_rank if p.mp_size > 1 else None): prefix
                  for idx, prefix in pipe.layer_state_prefixes().items()}
    return {"topology": p.topology(), "layers": layers}


def model_states_file(run: Run) -> str:
    return model_states_name(run.place.slice)


def optim_states_file(run: Run) -> str:
    """DeepSpeed's name, bf16_ prefix included under bf16."""
    p = run.place
    return optim_states_name(p.dp_rank, p.slice, bf16=run.compute_dtype == torch.bfloat16)


def zero_model_states_file(run: Run) -> str:
    """ZeRO-3: every rank writes its own model-states file."""
    p = run.place
    return zero_model_states_name(p.dp_rank, p.slice)


def writes_model_states(run: Run, writes_shared: bool) -> bool:
    """One writer per (pipe, model) slice: its first data-parallel rank (rank 0 / the
    storage leader when the model is not split)."""
    p = run.place
    return writes_shared if p.slices == 1 else p.dp_rank == 0


def layer_files(run: Run, module_state: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
    """A pipeline stage's layer files: file name -> that layer's own state_dict."""
    pipe = _pipeline_module(run)
    if pipe is None:
        return {}
    p = run.place
    out = {}
    for idx, prefix in pipe.layer_state_prefixes(own=True).items():
        head = prefix + "."
        out[layer_states_name(idx, p.mp_rank if p.mp_size > 1 else None)] = {
            k[len(head):]: v for k, v in module_state.items() if k.startswith(head)}
    return out


# -- loading (reader.Checkpoint, dslaunch's or DeepSpeed's) -----------------------------------------
def same_layout(ck, run: Run) -> bool:
    """Saved and resumed at the same topology, with the same kind of model."""
    return ck.topology == run.place.topology() and bool(ck.layers) == (_pipeline_module(run) is not None)


def _layer_index(name: str) -> int:
    return int(name.split("_", 1)[1].split("-", 1)[0])


def target_prefixes(run: Run, ck) -> Dict[int, str]:
    """Global layer index -> the prefix its state takes in this engine's module."""
    pipe = _pipeline_module(run)
    if pipe is not None:
        return pipe.layer_state_prefixes(own=True)
    try:
        return to_layers_prefixes(run.module)
    except PipelineError:
        raise CheckpointError(f"checkpoint {ck.path} was saved by a pipeline (one file per layer); to load it into a "
                              "model without a pipeline, the model needs to_layers() (its layers in pipeline "
                              "order)") from None


def module_state(ck, run: Run, everything: bool = False) -> Dict[str, torch.Tensor]:
    """The module state this engine loads: the saved module (no pipeline), or the state
    rebuilt from layer files under this module's names (`everything`: every saved layer,
    under the saved pipeline names, e.g. to re-cut optimizer state by name)."""
    if run is not None and not everything:
        place = run.place
        if tensor_slices.applies(ck, place, _pipeline_module(run) is not None):
            return tensor_slices.module_state(ck, run.module, place.mp_size, place.mp_rank)
    if not ck.layers:
        if run is not None and _pipeline_module(run) is not None and not everything:
            raise CheckpointError(f"checkpoint {ck.path} was saved without a pipeline; a PipelineModule loads only "
                                  "pipeline checkpoints (load it into the model it was saved from)")
        return ck.module_state()
    prefixes = None if everything or run is None else target_prefixes(run, ck)
    out = {}
    for name, saved_prefix in sorted(ck.layers.items()):
        idx = _layer_index(name)
        if prefixes is None:
            prefix = saved_prefix
        elif idx in prefixes:
            prefix = prefixes[idx]
        elif _pipeline_module(run) is not None:
            continue  # another stage's layer
        else:
            raise CheckpointError(f"checkpoint {ck.path}: layer {idx} has weights ({name}) but layer {idx} of this "
                                  f"model's to_layers() is not one of its modules")
        out.update({f"{prefix}.{k}" if prefix else k: v for k, v in ck.read(name).items()})
    return out


def _stage0_as_shard(ck, state: Dict[str, Any], module: Dict[str, torch.Tensor]) -> List[Dict[str, Any]]:
    names = state.get("param_names")
    if names is None:
        raise CheckpointError(f"checkpoint {ck.path}: its optimizer state has no parameter names, so it cannot be "
                              "re-cut for another topology (not saved by dslaunch); resume at the topology "
                              "that saved it")
    return shards_from_stage0(state, names, module)


def _rename(shards: List[Dict[str, Any]], rename: Dict[str, str]) -> List[Dict[str, Any]]:
    def key(n):
        return rename.get(n, n)

    out = []
    for sh in shards:
        groups = []
        for g in sh["groups"]:
            groups.append({
                "pieces": [dict(p, name=key(p["name"])) for p in g["pieces"]],
                "shapes": {key(n): s for n, s in g["shapes"].items()},
                "master": {key(n): t for n, t in g["master"].items()},
                "state": {k: ({key(n): t for n, t in v.items()} if isinstance(v, dict) else v)
                          for k, v in g["state"].items()},
            })
        out.append(dict(sh, groups=groups))
    return out


def saved_name_map(ck, run: Run) -> Dict[str, str]:
    """Saved parameter name -> this engine's name (identity within pipelines)."""
    if not ck.layers or _pipeline_module(run) is not None:
        return {}
    prefixes = target_prefixes(run, ck)
    out = {}
    for name, saved_prefix in ck.layers.items():
        idx = _layer_index(name)
        if idx in prefixes:
            for k in ck.read(name):
                out[f"{saved_prefix}.{k}"] = f"{prefixes[idx]}.{k}" if prefixes[idx] else k
    return out


def slice_shards(ck, slice_: int) -> List[Dict[str, Any]]:
    """One (pipe, model) slice's optimizer state as name-keyed shards (every data rank's)."""
    if ck.sharded:
        return [ck.shard(d, slice_, mmap=True) for d in range(ck.world_size)]
    model = ck.model_of(slice_)
    return _stage0_as_shard(ck, ck.stage0_state(model), model["module"])


def all_shards(ck, run: Optional[Run] = None) -> List[Dict[str, Any]]:
    """Every saved rank's optimizer state as name-keyed shards (ZeRO files converted from
    DeepSpeed's flat partitions, each slice's unsharded state re-cut by name), renamed for
    `engine`'s module."""
    if ck.sharded:
        shards = [ck.shard(d, s, mmap=True) for s in range(ck.slices) for d in range(ck.world_size)]
    else:
        full = None
        shards = []
        for s in range(ck.slices):
            state = ck.stage0_state(ck.model_of(s))
            if full is None:
                full = module_state(ck, run, everything=True)
            shards += _stage0_as_shard(ck, state, full)
    if run is not None:
        rename = saved_name_map(ck, run)
        if rename:
            shards = _rename(shards, rename)
    return shards


def full_saved_module_state(ck) -> Dict[str, torch.Tensor]:
    """Every saved weight under its saved name (a pipeline's layers merged), for consolidation."""
    return module_state(ck, None, everything=True)
