"""engine.load_checkpoint: read and check everything first, then apply.

Reading (every rank, its own files): the manifest (sizes of all files), then each file
this rank needs after its checksum is verified, through torch.load(weights_only=True);
the module state is checked against the model (names and full shapes, ZeRO-3 included:
a partitioned parameter's full shape is taken from its ZeRO record, not from the empty
tensor the module holds at rest). All ranks then agree; only if every rank has read
everything is any state changed, so a missing, damaged, foreign or mismatched
checkpoint is one CheckpointError line on every rank and loads nothing.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from .agree import agree
from .errors import CheckpointError
from .files import load_torch
from .layout import read_latest, rng_states_name, validate_tag
from .manifest import Manifest
from .rng import set_rng_state
from .saving import CLIENT_STATE_FILE
from . import parallel


@dataclass
class _Loaded:
    path: str
    model: Dict[str, Any]
    optim: Any  # this rank's state, every saved rank's shard (re-sharding), or None
    rng: Optional[Dict[str, Any]]
    client_state: Dict[str, Any]


def full_shapes(module: torch.nn.Module) -> Dict[str, Tuple[int, ...]]:
    """state_dict name -> full shape, also for ZeRO-3 parameters partitioned at rest."""
    out = {}
    for k, v in module.state_dict(keep_vars=True).items():
        z = getattr(v, "_zero", None)  # zero/params.ZeroParam: the full shape of a partitioned parameter
        out[k] = tuple(z.shape) if z is not None else tuple(v.shape)
    return out


def check_module_state(module: torch.nn.Module, state: Any, path: str, strict: bool = True) -> None:
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"checkpoint {path} is damaged: its module state is not a dict of tensors")
    own = full_shapes(module)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:5]}"
                              f"{' (+%d more)' % (len(missing) - 5) if len(missing) > 5 else ''}, "
                              f"unexpected {unexpected[:5]}"
                              f"{' (+%d more)' % (len(unexpected) - 5) if len(unexpected) > 5 else ''}")
    for k, shape in own.items():
        if k in state and tuple(state[k].shape) != shape:
            raise CheckpointError(f"checkpoint {path}: {k} has shape {tuple(state[k].shape)}, the model has {shape}")


def _field(d: Any, key: str, path: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointError(f"checkpoint {path} is damaged: its model states lack {key!r}")
    return d[key]


def _read(engine, path: str, strict: bool, load_optimizer_states: bool, load_module_only: bool,
          trust_pickle: bool) -> _Loaded:
    manifest = Manifest.read(path)
    rank, strategy = engine.global_rank, engine.strategy
    model = load_torch(manifest.verify(path, parallel.own_model_states(manifest, path, engine)),
                       trust_pickle=trust_pickle)
    _field(model, "module", path)
    # the module state under this module's names: its own, or rebuilt from a pipeline's layer files
    module = parallel.module_state(manifest, path, engine, model)
    check_module_state(engine.module, module, path, strict)
    model = dict(model, module=module)
    client_state = _field(model, "client_state", path)
    if manifest.pickled_client_state:
        if not trust_pickle:
            raise CheckpointError(f"checkpoint {path}: its client_state was saved with allow_pickle=True and needs "
                                  "pickle to load; pass trust_pickle=True if you trust its source")
        client_state = load_torch(manifest.verify(path, CLIENT_STATE_FILE), trust_pickle=True)

    optim = None
    if load_optimizer_states and not load_module_only:
        sharded = manifest.sharded_optimizer_state
        same = parallel.same_layout(manifest, engine)
        # Strategies with loads_any_world_size (stage 0 and ZeRO) re-cut what was saved at
        # another topology or stage (reshard.py, parallel.py): they get every saved rank's
        # state keyed by parameter name, ZeRO files memory-mapped so only the overlapping
        # pieces are read.
        anywhere = getattr(strategy, "loads_any_world_size", False)
        if not same and not anywhere:
            raise CheckpointError(f"checkpoint {path} was saved at topology {manifest.topology or manifest.world_size} "
                                  f"and this job runs {parallel.placement(engine).topology()}; its optimizer state "
                                  "cannot be re-cut here (consolidate it or load with load_optimizer_states=False)")
        if not same or (sharded and anywhere and manifest.zero_stage != strategy.stage):
            if manifest.node_local:
                raise CheckpointError(f"checkpoint {path} was saved with checkpoint.use_node_local_storage: a node "
                                      "holds only its own ranks' optimizer shards, not all those needed to re-shard "
                                      "it; resume on the nodes and world size that saved it")
            optim = parallel.all_shards(manifest, path, engine)
        elif sharded:
            optim = load_torch(manifest.verify(path, parallel.optim_states_file(engine)))
        else:
            optim = _field(model, "optimizer", path)
    rng = None
    if not load_module_only and rng_states_name(rank) in manifest.files:
        rng = load_torch(manifest.verify(path, rng_states_name(rank)))
    return _Loaded(path, model, optim, rng, client_state)


def _apply(engine, got: _Loaded, strict: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> None:
    strategy, model = engine.strategy, got.model
    strategy.load_module_state_dict(model["module"], strict=strict)
    if load_module_only:
        return
    if got.optim is not None:
        strategy.load_optimizer_state_dict(got.optim)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and model.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
    if engine.loss_scaler is not None and model.get("loss_scaler") is not None:
        engine.loss_scaler.load_state_dict(model["loss_scaler"])
    engine.load_counters_state(_field(model, "counters", got.path))
    if got.rng is not None:
        set_rng_state(got.rng)


def resolve(load_dir: str, tag) -> Optional[str]:
    """The checkpoint directory to load: `tag` (validated) or the one `latest` names;
    None when tag is None and there is no `latest`."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
    else:
        tag = validate_tag(tag, "load_checkpoint tag")
    return os.path.join(load_dir, tag)


def _same_checkpoint(paths) -> Optional[str]:
    """Every rank must load the same tag (with node-local storage each node reads its own
    `latest`, which a crash can leave behind on one node)."""
    tags = [None if p is None else os.path.basename(p) for p in paths]
    if len(set(tags)) > 1:
        shown = ", ".join(f"rank {r} {t!r}" for r, t in enumerate(tags) if t != tags[0])
        return f"load_checkpoint: ranks resolved different checkpoints: rank 0 {tags[0]!r}, {shown}"
    return None


def load(engine, load_dir: str, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False,
         trust_pickle: bool = False) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    load_dir = str(load_dir)
    path, error = None, None
    try:
        path = resolve(load_dir, tag)
    except CheckpointError as exc:
        error = str(exc)
    paths = agree(error, path)
    error = _same_checkpoint(paths)
    if error:
        raise CheckpointError(error)
    if path is None:
        # DeepSpeed's behaviour, which "resume if possible" scripts rely on: nothing to load.
        if engine.global_rank == 0:
            print(f"dslaunch: load_checkpoint: no checkpoint in {load_dir} ({os.path.join(load_dir, 'latest')} does "
                  "not exist); nothing loaded", file=sys.stderr, flush=True)
        return None, None
    got = None
    try:
        got = _read(engine, path, load_module_strict, load_optimizer_states, load_module_only, trust_pickle)
    except CheckpointError as exc:
        error = str(exc)
    agree(error)
    _apply(engine, got, load_module_strict, load_lr_scheduler_states, load_module_only)
    return got.path, got.client_state
