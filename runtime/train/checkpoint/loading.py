"""engine.load_checkpoint: read and check everything first, then apply.

Reading (every rank, its own files, through reader.py: dslaunch's checkpoints and
DeepSpeed's alike): the manifest (sizes of all files) when there is one, then each file
this rank needs after its checksum is verified, through torch.load(weights_only=True);
the module state is checked against the model (names and full shapes, ZeRO-3 included:
a partitioned parameter's full shape is taken from its ZeRO record, not from the empty
tensor the module holds at rest). All ranks then agree; only if every rank has read
everything is any state changed, so a missing, damaged, foreign or mismatched
checkpoint is one CheckpointError line on every rank and loads nothing.

Any saved world size, stage and topology loads into any current one: ZeRO shards are
re-cut by parameter name (reshard.py); a stage-0 checkpoint's torch optimizer state is cut
into shards for ZeRO, and shards are made whole for stage 0; a pipeline's layer files and
per-stage states are matched by layer index and parameter name (parallel.py).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from .run import Run
from .agree import agree
from ...core.errors import CheckpointError
from ...core.shard_state import SavedShards, ShardLayout
from .files import load_torch
from .layout import LATEST, model_states_name, read_latest, rng_states_name, validate_tag
from .reader import Checkpoint, open_checkpoint
from .saving import CLIENT_STATE_FILE
from . import autoep, moe, optimizer_state, parallel, tensor_slices, universal


@dataclass
class _Loaded:
    path: str
    module: Dict[str, torch.Tensor]
    optim: Any  # this rank's shard, every saved rank's shard (re-sharding), a stage-0 state, or None
    rng: Optional[Dict[str, Any]]
    client_state: Dict[str, Any]
    counters: Dict[str, int]
    lr_scheduler: Optional[Dict[str, Any]]
    loss_scaler: Optional[Dict[str, Any]]


def full_shapes(module: torch.nn.Module) -> Dict[str, Tuple[int, ...]]:
    """state_dict name -> full shape, also for ZeRO-3 parameters partitioned at rest."""
    out = {}
    for k, v in module.state_dict(keep_vars=True).items():
        z = getattr(v, "_zero", None)  # zero/params.ZeroParam: the full shape of a partitioned parameter
        out[k] = tuple(z.shape) if z is not None else tuple(v.shape)
    return out


def _more(items) -> str:
    return f"{items[:5]}{' (+%d more)' % (len(items) - 5) if len(items) > 5 else ''}"


def check_module_shapes(module: torch.nn.Module, saved: Dict[str, Tuple[int, ...]], path: str,
                        strict: bool = True) -> None:
    own = full_shapes(module)
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {_more(missing)}, "
                              f"unexpected {_more(unexpected)}")
    for k, shape in own.items():
        if k in saved and tuple(saved[k]) != shape:
            raise CheckpointError(f"checkpoint {path}: {k} has shape {tuple(saved[k])}, the model has {shape}")


def _optimizer_state(run: Run, ck: Checkpoint, layout: ShardLayout) -> Any:
    place = run.place
    if tensor_slices.applies(ck, place, parallel.is_pipeline(run)):
        if not layout.recuts:
            raise CheckpointError(f"checkpoint {ck.path} was saved at topology {ck.topology} and this job runs "
                                  f"{place.topology()}; ZeRO stage {layout.zero_stage} cannot re-cut its optimizer "
                                  "state (load with load_optimizer_states=False)")
        return tensor_slices.optimizer_shard(ck, run.module, place.mp_size, place.mp_rank,
                                             lambda s: parallel.slice_shards(ck, s))
    if not ck.sharded and ck.slices == 1 and not ck.layers and not parallel.is_pipeline(run):
        return ck.stage0_state()  # one whole state, whatever the data-parallel size
    same = parallel.same_layout(ck, run)
    # Strategies with loads_any_world_size (stage 0 and ZeRO) re-cut what was saved at
    # another topology or stage (reshard.py, parallel.py): they get every saved rank's
    # state keyed by parameter name, ZeRO files memory-mapped so only the overlapping
    # pieces are read.
    anywhere = layout.recuts
    if not same and not anywhere:
        raise CheckpointError(f"checkpoint {ck.path} was saved at topology {ck.topology} and this job runs "
                              f"{place.topology()}; its optimizer state cannot be re-cut here (consolidate it or "
                              "load with load_optimizer_states=False)")
    if not same or (ck.sharded and anywhere and ck.zero_stage != layout.zero_stage):
        if ck.manifest is not None and ck.manifest.node_local:
            needed = ([ck.optim_name(d, s) for s in range(ck.slices) for d in range(ck.world_size)] if ck.sharded
                      else [model_states_name(s) for s in range(ck.slices)]) + sorted(ck.layers)
            held = [n for n in needed if n in ck.manifest.files]
            if len(held) < len(needed):
                raise CheckpointError(f"checkpoint {ck.path} was saved with checkpoint.use_node_local_storage: this "
                                      f"node holds {len(held)} of the {len(needed)} files needed to re-shard it; "
                                      "resume on the nodes and world size that saved it")
        return parallel.all_shards(ck, run)
    if ck.sharded:
        return ck.shard(place.dp_rank, place.slice)
    return ck.stage0_state()


def _read(run: Run, layout: ShardLayout, path: str, strict: bool, load_optimizer_states: bool, load_module_only: bool,
          trust_pickle: bool) -> _Loaded:
    ck = open_checkpoint(path, trust_pickle=trust_pickle, placement=run.place)
    autoep_records = autoep.saved_layers(ck)
    if autoep_records is not None or autoep.layers(run.module):
        return _read_autoep(run, layout, ck, autoep_records, strict, load_optimizer_states, load_module_only,
                            trust_pickle)
    experts = moe.saved_experts(ck)
    if experts is None and moe.moe_layers(run.module) and run.expert_parallel_size > 1:
        raise CheckpointError(f"checkpoint {path} has no MoE expert files (layer_*_expert_*); this model's experts "
                              f"are spread over {run.expert_parallel_size} ranks")
    if experts is not None and not moe.moe_layers(run.module):
        raise CheckpointError(f"checkpoint {path} holds MoE expert files but this model has no MoE layers")
    # the module state under this module's names: its own, or rebuilt from a pipeline's layer
    # files, or (MoE) the dense weights and this rank's experts by global expert id
    module = moe.module_state(ck, run, experts) if experts is not None else parallel.module_state(ck, run)
    optim = None
    if load_optimizer_states and not load_module_only:
        # MoE: every saved optimizer state, renamed to this rank's experts, re-cut by the strategy
        optim = (moe.optimizer_shards(ck, run, experts) if experts is not None
                 else _optimizer_state(run, ck, layout))
    return _finish(run, ck, module, optim, strict, load_module_only, trust_pickle)


def _read_autoep(run: Run, layout: ShardLayout, ck: Checkpoint, records, strict: bool, load_optimizer_states: bool, load_module_only: bool,
                 trust_pickle: bool) -> _Loaded:
    """An AutoEP model (autoep.py): its experts stacked from the per-expert files; the
    optimizer state at the autoep_size (and ZeRO layout) that saved it."""
    if records is None:
        raise CheckpointError(f"checkpoint {ck.path} has no AutoEP layer records ({autoep.LAYERS_KEY}); this model's "
                              "MoE blocks were swapped by AutoEP (expert_parallel)")
    if not autoep.layers(run.module):
        raise CheckpointError(f"checkpoint {ck.path} was saved with AutoEP (expert_parallel) and this model has no "
                              "AutoEP layers; enable the same expert_parallel section")
    module = autoep.module_state(ck, run, records)
    optim = None
    if load_optimizer_states and not load_module_only:
        autoep.check_optimizer_layout(ck, run, records, parallel.same_layout(ck, run))
        if ck.zero_stage != layout.zero_stage:
            raise CheckpointError(f"checkpoint {ck.path} was saved at ZeRO stage {ck.zero_stage} and this job runs "
                                  f"stage {layout.zero_stage}: an AutoEP model's optimizer state is not re-cut "
                                  "here (load with load_optimizer_states=False)")
        optim = autoep.stage0_state(ck, run) if not ck.sharded else ck.shard(run.place.dp_rank,
                                                                                 run.place.slice)
    return _finish(run, ck, module, optim, strict, load_module_only, trust_pickle)


def _finish(run: Run, ck: Checkpoint, module, optim, strict: bool, load_module_only: bool, trust_pickle: bool
            ) -> _Loaded:
    path, rank = ck.path, run.global_rank
    check_module_shapes(run.module, {k: tuple(v.shape) for k, v in module.items()}, path, strict)
    client_state = ck.client_state()
    if ck.manifest is not None and ck.manifest.pickled_client_state:
        if not trust_pickle:
            raise CheckpointError(f"checkpoint {path}: its client_state was saved with allow_pickle=True and needs "
                                  "pickle to load; pass trust_pickle=True if you trust its source")
        client_state = load_torch(ck.manifest.verify(path, CLIENT_STATE_FILE), trust_pickle=True, within=path)
    # whatever optimizer saved it (DeepSpeed's FusedAdam, its CPU optimizers, torch's), in this one's form
    optim = optimizer_state.to_ours(optim, getattr(run.strategy, "optimizer", None), f"checkpoint {path}")
    rng = None
    if not load_module_only and ck.manifest is not None and rng_states_name(rank) in ck.manifest.files:
        rng = ck.read(rng_states_name(rank))
    return _Loaded(path, module, optim, rng, client_state,
                   ck.counters(run.accumulation), ck.lr_scheduler,
                   ck.loss_scaler_state() if run.loss_scaler is not None and not load_module_only else None)


def _read_universal(run: Run, layout: ShardLayout, path: str, strict: bool, load_optimizer_states: bool, load_module_only: bool,
                    trust_pickle: bool) -> _Loaded:
    """A DeepSpeed universal folder (universal.py): whole fp32 weights and optimizer states per
    parameter, handed to the strategy as one name-keyed shard it re-cuts for this world size
    and stage, as any re-shard."""
    place = run.place
    if parallel.is_pipeline(run):
        raise CheckpointError(f"universal checkpoint {path}: loading one into a pipeline is not supported (load it "
                              "without one, save, and resume from that checkpoint)")
    uc = universal.open_universal(path, trust_pickle=trust_pickle)
    module = uc.module_state()
    shard = None
    if load_optimizer_states and not load_module_only:
        if not layout.recuts:
            raise CheckpointError(f"universal checkpoint {path}: ZeRO stage {layout.zero_stage} cannot load "
                                  "re-cut optimizer state (load with load_optimizer_states=False)")
        shard = uc.shard()
    if place.mp_size > 1:  # this tensor rank's slices, cut by the splits the model's layers record
        module, shard = tensor_slices.cut_whole(module, shard, run.module, place.mp_size, place.mp_rank, path)
    check_module_shapes(run.module, {k: tuple(v.shape) for k, v in module.items()}, path, strict)
    optim = None
    if shard is not None:
        optim = optimizer_state.to_ours([shard], getattr(run.strategy, "optimizer", None),
                                        f"universal checkpoint {path}")
    return _Loaded(path, module, optim, None, uc.client_state(), uc.counters(run.accumulation),
                   uc.model.get("lr_scheduler"),
                   uc.loss_scaler_state() if run.loss_scaler is not None and not load_module_only else None)


def saved_shards(optim: Any) -> SavedShards:
    """What was read for this rank's optimizer in the shard vocabulary: a list of name-keyed
    shards (every saved rank's, or a universal folder's one), one shard (this rank's), or a
    whole state ({"optimizer": torch state_dict, ...})."""
    if isinstance(optim, list):
        return SavedShards(shards=optim)
    if isinstance(optim, dict) and "groups" in optim:
        return SavedShards(shards=[optim])
    return SavedShards(whole=optim)


def _apply(run: Run, got: _Loaded, strict: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> None:
    strategy = run.strategy
    strategy.load_module_state_dict(got.module, strict=strict)
    if load_module_only:
        return
    if got.optim is not None:
        strategy.load_shard_state(saved_shards(got.optim))
    if load_lr_scheduler_states and run.lr_scheduler is not None and got.lr_scheduler is not None:
        run.lr_scheduler.load_state_dict(got.lr_scheduler)
    if run.loss_scaler is not None and got.loss_scaler is not None:
        state = run.loss_scaler.state_dict()
        state.update({k: v for k, v in got.loss_scaler.items() if k in state})
        run.loss_scaler.load_state_dict(state)
    run.restore_counters(got.counters)
    if got.rng is not None:
        from .rng import set_rng_state

        set_rng_state(got.rng)


def resolve(load_dir: str, tag, load_universal: bool = False) -> Optional[str]:
    """The checkpoint directory to load: `tag` (validated) or the one `latest` names;
    None when tag is None and there is no `latest`. With load_universal, `latest_universal`
    names it and must exist (as DeepSpeed requires)."""
    if tag is None:
        tag = read_latest(load_dir, universal.LATEST_UNIVERSAL if load_universal else LATEST)
        if tag is None and load_universal:
            raise CheckpointError(f"load_checkpoint: checkpoint.load_universal is set but "
                                  f"{os.path.join(load_dir, universal.LATEST_UNIVERSAL)} does not exist (write one "
                                  "with `dslaunch ds_to_universal`, or pass tag=)")
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


def load(run: Run, load_dir: str, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False,
         trust_pickle: bool = False) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    load_dir = str(load_dir)
    path, error = None, None
    load_universal = bool(run.config.checkpoint.load_universal)
    try:
        path = resolve(load_dir, tag, load_universal)
    except CheckpointError as exc:
        error = str(exc)
    paths = agree(error, path)
    error = _same_checkpoint(paths)
    if error:
        raise CheckpointError(error)
    if path is None:
        # DeepSpeed's behaviour, which "resume if possible" scripts rely on: nothing to load.
        if run.global_rank == 0:
            print(f"dslaunch: load_checkpoint: no checkpoint in {load_dir} ({os.path.join(load_dir, 'latest')} does "
                  "not exist); nothing loaded", file=sys.stderr, flush=True)
        return None, None
    got = None
    try:
        read = _read_universal if load_universal else _read
        got = read(run, run.strategy.shard_layout(), path, load_module_strict, load_optimizer_states, load_module_only, trust_pickle)
    except CheckpointError as exc:
        error = str(exc)
    agree(error)
    with torch.no_grad():  # restoring state is not part of any graph
        _apply(run, got, load_module_strict, load_lr_scheduler_states, load_module_only)
    return got.path, got.client_state
