"""Open a checkpoint directory, dslaunch's or DeepSpeed's, as one `Checkpoint`.

Both tools write the same layout (layout.py) and keys (dsformat.py); dslaunch adds
manifest.json, RNG files and its extras under the "dslaunch" key. With a manifest, every
file is size-checked when the checkpoint is opened and checksum-verified when read; a
directory without one is read as DeepSpeed's (a model-states file carrying our "dslaunch"
key but no manifest is a damaged dslaunch checkpoint and is refused). Every file is
read with weights_only=True and DeepSpeed's own classes through foreign.py's stand-ins.

What the loader and `dslaunch consolidate` get, whoever wrote the checkpoint:
  module_state()   the full module state (ZeRO-3's placeholders rebuilt from the fp32
                   shards, frozen parameters from their fragments, tied names restored);
                   a pipeline's layer files are merged by parallel.py
  shard(dp, slice) a ZeRO shard in reshard.py's form
  stage0_state()   {"optimizer": torch state_dict, "fp32_masters": [...] | None}
  counters(), client_state(), loss_scaler_state(), lr_scheduler
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .dsformat import (DS_KEYS, ShapeError, kind_of_stage, loss_scaler_from_ds, offloaded, shard_from_ds, shape_problem,
                       stage0_from_ds)
from ...core.errors import CheckpointError
from ...core.shard_state import ShardKind
from .files import load_torch
from .layout import MANIFEST, model_states_name, optim_states_name, zero_model_states_name
from .manifest import Manifest
from ...zero.reshard import full_fp32_params


@dataclass
class Checkpoint:
    path: str
    manifest: Optional[Manifest]
    model: Dict[str, Any]  # the model-states file this rank reads (its slice's, else slice 0's)
    zero_stage: int
    topology: Dict[str, int]  # saved {"pipe", "data", "model"} sizes
    layers: Dict[str, str] = field(default_factory=dict)  # pipelines: layer file -> its state prefix
    trust_pickle: bool = False
    _bf16: bool = False
    _models: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    # -- files --------------------------------------------------------------------------------
    def read(self, name: str, mmap: bool = False) -> Any:
        fpath = self.manifest.verify(self.path, name) if self.manifest else os.path.join(self.path, name)
        return load_torch(fpath, mmap=mmap, trust_pickle=self.trust_pickle, within=self.path)

    def model_of(self, slice_: int) -> Dict[str, Any]:
        """The model-states file of one (pipe, model) slice (ZeRO-3: its data-parallel rank 0's)."""
        name = zero_model_states_name(0, slice_) if self.kind is ShardKind.PER_PARAMETER else model_states_name(slice_)
        if name not in self._models:
            model = self.read(name)
            if not isinstance(model, dict):
                raise CheckpointError(f"checkpoint {self.path} is damaged: {name} is not a model-states dict")
            self._models[name] = model
        return self._models[name]

    @property
    def dslaunch(self) -> Dict[str, Any]:
        extra = self.model.get("dslaunch")
        return extra if isinstance(extra, dict) else {}

    @property
    def kind(self) -> ShardKind:
        """How the saved optimizer state is laid out (from the ZeRO stage its files record)."""
        return kind_of_stage(self.zero_stage, f"checkpoint {self.path}: ")

    @property
    def sharded(self) -> bool:
        return self.kind is not ShardKind.WHOLE

    @property
    def world_size(self) -> int:
        """Saved data-parallel size."""
        return self.topology["data"]

    @property
    def slices(self) -> int:
        return self.topology["pipe"] * self.topology["model"]

    def optim_name(self, dp_rank: int, slice_: int = 0) -> str:
        return optim_states_name(dp_rank, slice_, bf16=self._bf16)

    # -- optimizer state ----------------------------------------------------------------------
    def shard(self, dp_rank: int, slice_: int = 0, mmap: bool = False) -> Dict[str, Any]:
        name = self.optim_name(dp_rank, slice_)
        state = self.read(name, mmap=mmap)
        try:
            return shard_from_ds(state["optimizer_state_dict"], self.param_shapes(slice_), dp_rank,
                                 offloaded(state.get("ds_config")))
        except (KeyError, TypeError):
            raise CheckpointError(f"checkpoint file {self.path}/{name} holds no optimizer_state_dict") from None
        except ShapeError as exc:  # the model states' param_shapes, measured against this file's buffers
            raise CheckpointError(f"checkpoint {self.path}: {exc}") from None
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint file {self.path}/{name} {exc}") from None

    def param_shapes(self, slice_: int = 0) -> List[Dict[str, Any]]:
        shapes = self.model_of(slice_).get("param_shapes")
        if not isinstance(shapes, list):
            raise CheckpointError(f"checkpoint {self.path}: its model states lack param_shapes")
        return shapes

    def stage0_state(self, model: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """{"optimizer": torch state_dict, "fp32_masters": [...] | None, "param_names": ...}."""
        model = self.model if model is None else model
        try:
            state = stage0_from_ds(model.get("optimizer"))
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {self.path}: its model states {exc}") from None
        names = (model.get("dslaunch") or {}).get("param_names")
        if names is not None:  # saved by dslaunch: every group's parameter names, masters in that order
            state["param_names"] = names
            state["master_names"] = [n for group in names for n in group]
        return state

    # -- module -------------------------------------------------------------------------------
    def module_state(self) -> Dict[str, torch.Tensor]:
        """The saved module (no pipeline); ZeRO-3's parameter placeholders rebuilt from the
        fp32 shards, frozen parameters from their fragments, tied names restored."""
        module = self.model.get("module")
        if not isinstance(module, dict) or not all(torch.is_tensor(v) for v in module.values()):
            raise CheckpointError(f"checkpoint {self.path} is damaged: its module state is not a dict of tensors")
        module = dict(module)
        if self.kind is not ShardKind.PER_PARAMETER:
            return module
        full = full_fp32_params([self.shard(r, mmap=True) for r in range(self.world_size)])
        for name, value in full.items():
            module[name] = value.to(module[name].dtype if name in module else torch.float32)
        frozen = self.model.get("frozen_param_shapes") or {}
        if frozen:
            frags = [self.read(zero_model_states_name(r)).get("frozen_param_fragments") or {}
                     for r in range(self.world_size)]
            for name, shape in frozen.items():
                problem = shape_problem(shape)
                pieces = [f.get(name) for f in frags]
                if problem or not all(torch.is_tensor(p) for p in pieces):
                    raise CheckpointError(f"checkpoint {self.path}: frozen_param_shapes: {name} has shape {shape}: "
                                          f"{problem or 'some rank saved no fragment of it'}")
                numel = int(torch.Size(shape).numel())
                held = sum(p.numel() for p in pieces)
                if numel > held:
                    raise CheckpointError(f"checkpoint {self.path}: frozen_param_shapes: {name} has shape "
                                          f"{tuple(shape)}: {numel} elements, and its fragments hold {held}")
                flat = torch.cat([p.reshape(-1) for p in pieces])[:numel]
                module[name] = flat.view(tuple(shape)).to(module[name].dtype if name in module else flat.dtype)
        for alias, canon in (self.model.get("shared_params") or {}).items():
            if canon in module:
                module[alias] = module[canon]
        return module

    # -- the rest -----------------------------------------------------------------------------
    @property
    def lr_scheduler(self) -> Optional[Dict[str, Any]]:
        return self.model.get("lr_scheduler")

    def counters(self, gradient_accumulation_steps: int) -> Dict[str, int]:
        if "counters" in self.dslaunch:
            out = dict(self.dslaunch["counters"])
            try:
                # the accumulation the job ran with (recorded since resizable jobs), else the config's
                saved_gas = int(out.pop("gradient_accumulation_steps", 0) or
                                (self.model.get("ds_config") or {}).get("gradient_accumulation_steps") or 0)
            except (TypeError, ValueError, AttributeError):
                saved_gas = 0
            if saved_gas and saved_gas != gradient_accumulation_steps:
                # resumed with another accumulation (another world size, same batch): the micro
                # steps into the current optimizer step carry over, the finished steps are recounted
                done = int(out["global_steps"])  # skipped (overflowed) steps included
                into = int(out["micro_steps"]) - done * saved_gas
                out["micro_steps"] = done * gradient_accumulation_steps + max(0, into)
            return out
        steps = int(self.model.get("global_steps", 0))
        return {"global_steps": steps, "micro_steps": steps * gradient_accumulation_steps,
                "global_samples": int(self.model.get("global_samples", 0)),
                "skipped_steps": int(self.model.get("skipped_steps", 0)), "dataloader_epoch": 0}

    def client_state(self) -> Dict[str, Any]:
        if "client_keys" in self.dslaunch:
            return {k: self.model[k] for k in self.dslaunch["client_keys"] if k in self.model}
        return {k: v for k, v in self.model.items() if k not in DS_KEYS}

    def loss_scaler_state(self) -> Optional[Dict[str, Any]]:
        if "loss_scaler" in self.dslaunch:
            return self.dslaunch["loss_scaler"]
        if self.kind is ShardKind.WHOLE:
            opt = self.model.get("optimizer")
            return stage0_from_ds(opt)["loss_scale"] if isinstance(opt, dict) else None
        optim = self.read(self.optim_name(0), mmap=True).get("optimizer_state_dict", {})
        return loss_scaler_from_ds(optim.get("loss_scaler"))


def _own_model_name(kind: ShardKind, dp_rank: int, slice_: int, listed, same: bool) -> str:
    if kind is ShardKind.PER_PARAMETER:
        own = zero_model_states_name(dp_rank, slice_)
        return own if same and own in listed else zero_model_states_name(0)
    own = model_states_name(slice_)
    return own if same and own in listed else model_states_name(0)


def open_checkpoint(path: str, trust_pickle: bool = False, placement=None) -> Checkpoint:
    """`placement` (checkpoint/parallel.py, this rank's coordinates) picks the model-states
    file to read: its own slice's (and ZeRO-3 data-parallel rank's) when the checkpoint was
    saved at the same topology, else the first slice's."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    manifest = Manifest.read(path) if os.path.exists(os.path.join(path, MANIFEST)) else None
    if manifest is not None:
        topology = dict(manifest.topology) or {"pipe": 1, "data": manifest.world_size, "model": 1}
        ck = Checkpoint(path, manifest, {}, manifest.zero_stage, topology, dict(manifest.layers), trust_pickle)
        ck._bf16 = any(n.startswith("bf16_") for n in manifest.files)
        same = placement is not None and placement.topology() == topology
        name = _own_model_name(ck.kind, placement.dp_rank if placement else 0,
                               placement.slice if placement else 0, manifest.files, same)
        ck.model = ck.read(name)
        if not isinstance(ck.model, dict):
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is not a model-states dict")
        return ck
    return _open_deepspeed(path, trust_pickle, placement)


_LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")
_TP_LAYER_FILE = re.compile(r"layer_\d+-model_\d+-model_states\.pt")


def _ds_layer_prefixes(ck: Checkpoint, names: List[str]) -> Dict[str, str]:
    """DeepSpeed's layer files -> the state prefix each fills (it records none): "<idx>" as
    DeepSpeed's PipelineModule names a layer, or "tied_modules.<key>" when param_shapes
    lists the file's weights only under one tied module's name."""
    params = [n for s in range(ck.slices) for group in (ck.model_of(s).get("param_shapes") or [])
              for n in group]
    tied = sorted({".".join(n.split(".")[:2]) for n in params if n.startswith("tied_modules.")})
    out = {}
    for name in names:
        idx = _LAYER_FILE.fullmatch(name).group(1).lstrip("0") or "0"
        out[name] = idx
        if tied and not any(n.startswith(idx + ".") for n in params):
            keys = list(ck.read(name))
            match = [t for t in tied if keys and all(f"{t}.{k}" in params for k in keys)]
            if len(match) == 1:
                out[name] = match[0]
    return out


def _open_deepspeed(path: str, trust_pickle: bool, placement) -> Checkpoint:
    """A directory without a manifest: DeepSpeed's checkpoint (a pipeline's, or one with
    tensor-parallel slices such as AutoTP training's mp_rank_XX files; not both)."""
    if os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt")):  # universal.py's layout
        raise CheckpointError(f"checkpoint {path} is a universal checkpoint; load it with "
                              '"checkpoint": {"load_universal": true}')
    name = next((n for n in (model_states_name(), zero_model_states_name(0))
                 if os.path.exists(os.path.join(path, n))), None)
    if name is None:
        raise CheckpointError(f"checkpoint {path} is incomplete or damaged: {MANIFEST} is missing or unreadable")
    ck = Checkpoint(path, None, {}, 0, {"pipe": 1, "data": 1, "model": 1}, trust_pickle=trust_pickle)
    ck.model = ck.read(name)
    if not isinstance(ck.model, dict) or "dslaunch" in ck.model:
        raise CheckpointError(f"checkpoint {path} is incomplete or damaged: {MANIFEST} is missing or unreadable")
    layers = sorted(n for n in os.listdir(path) if _LAYER_FILE.fullmatch(n))
    try:
        ck.topology["data"] = int(ck.model["dp_world_size"])
        mp = int(ck.model.get("mp_world_size") or 1)  # DeepSpeed's grid: the (pipe, model) slice size
        dims = ck.model.get("checkpoint_parallel_dimensions") or {}
        tp = int(dims.get("tp_degree") or (1 if layers else mp))
    except (KeyError, TypeError, ValueError, AttributeError):
        raise CheckpointError(f"checkpoint {path}: {name} is neither dslaunch's nor DeepSpeed's "
                              "(no dp_world_size)") from None
    if layers and (tp != 1 or any(_TP_LAYER_FILE.fullmatch(n) for n in os.listdir(path))):
        raise CheckpointError(f"checkpoint {path}: DeepSpeed pipeline checkpoints with tensor (model) parallelism "
                              f"(mp_world_size {mp}) are not read")
    if not layers and tp != mp:
        raise CheckpointError(f"checkpoint {path}: mp_world_size {mp} but tp_degree {tp}: not a layout dslaunch "
                              "reads")
    # a pipeline's slices are its stages; without one they are tensor ranks (AutoTP, Megatron)
    ck.topology["pipe"], ck.topology["model"] = (mp, 1) if layers else (1, mp)
    if not layers and mp > 1 and placement is not None and placement.topology() == ck.topology:
        ck.model = ck.model_of(placement.slice)  # this tensor rank's own module state
    ck._bf16 = os.path.exists(os.path.join(path, optim_states_name(0, bf16=True)))
    if layers:
        ck.layers = _ds_layer_prefixes(ck, layers)
        if placement is not None and placement.topology() == ck.topology:
            ck.model = ck.model_of(placement.slice)  # this stage's scheduler, counters, stage-0 optimizer
    if name == zero_model_states_name(0):
        ck.zero_stage = 3
        rank = placement.dp_rank if placement is not None else 0
        if 0 < rank < ck.world_size:
            ck.model = ck.read(zero_model_states_name(rank))
    elif ck.model.get("optimizer") is None and ck.model.get("param_shapes") is not None:
        try:
            ck.zero_stage = int(ck.read(ck.optim_name(0), mmap=True)["optimizer_state_dict"]["zero_stage"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"checkpoint {path}: {ck.optim_name(0)} names no zero_stage") from None
    return ck
