"""engine.save_checkpoint: write every rank's files, then commit the tag atomically.

Phases (each ends with every rank agreeing on success, so one rank's failure is every
rank's one-line CheckpointError, never a hang):

  0. every rank's tag is compared (checkpoint.tag_validation) and rank 0's is used;
  1. rank 0 checks that SAVE_DIR can be written (before any state is gathered), checks
     client_state, and creates SAVE_DIR/.tmp.TAG/;
  2. every rank gathers its state (collective under ZeRO-3) and writes its files there,
     each through a .part name, checksummed as it is written;
  3. rank 0 writes manifest.json (sizes and checksums of all ranks' files) and commits.

With checkpoint.use_node_local_storage, SAVE_DIR is a disk of each node's own: what rank 0
does above, each node's local rank 0 does for its node (its manifest lists the files on
that node; every node gets the model states and its own `latest`), and a rank reads only
what its node holds, so such a checkpoint resumes on the same nodes and world size.

The commit never leaves `latest` naming a checkpoint that cannot be loaded, at any
instant, also when TAG already exists (a tag saved again) and `latest` names it:

  a. .old.TAG  <- hard links to TAG's files (no data copied)    latest: TAG (old, complete)
  b. latest    <- ".old.TAG"                                     latest: the old checkpoint
  c. TAG -> .trash.TAG ; .tmp.TAG -> TAG  (two renames)           latest: still .old.TAG
  d. latest    <- TAG                                            latest: the new checkpoint
  e. remove .old.TAG, .trash.TAG and leftovers of earlier crashed saves

`latest` itself is replaced by rename, so it is always one whole tag. Killed anywhere,
the directory holds either the old checkpoint or the new one under the name `latest`
gives, and the next save clears the leftovers. `_crash_hook` is called after each step
so a test can kill the process there.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import torch

from .run import Run
from .agree import agree
from ...core.errors import CheckpointError, TagMismatchError
from .files import FileRecord, ensure_writable_dir, fsync_dir, plain_value_problem, remove_tree, write_bytes, \
    write_torch
from . import tensor_slices
from . import dsformat
from .foreign import loss_scaler_record
from .layout import LATEST, PREVIOUS, RECOVERY_SCRIPT, STAGING, TRASH, read_latest, rng_states_name, validate_tag
from .manifest import Manifest
from .optimizer_state import deepspeed_optimizer_of
from ...core.shard_state import FrozenRecord, ShardKind, ShardState
from ...zero.reshard import tied_aliases
from .rng import rng_state
from . import autoep, moe, parallel

CLIENT_STATE_FILE = "client_state.pt"  # only with allow_pickle=True and objects that need pickle

_crash_hook: Callable[[str], None] = lambda step: None


def _step(name: str) -> None:
    _crash_hook(name)


# A script's own universal_checkpoint_info (Megatron-DeepSpeed passes its parameter patterns
# under it in every save) is stored as DeepSpeed stores it, unless the checkpoint writes its own
# (AutoEP's layer records), where DeepSpeed refuses it too.
CLIENT_UC_INFO = "universal_checkpoint_info"


def _client_keys_problem(client_state: Dict[str, Any], writes_uc_info: bool = False) -> Optional[str]:
    if not isinstance(client_state, dict):
        return f"client_state must be a dict, not {type(client_state).__name__}"
    for k in client_state:
        if not isinstance(k, str):
            return f"client_state key {k!r} is not a string"
        if k == CLIENT_UC_INFO and not writes_uc_info:
            continue
        if k in dsformat.DS_KEYS:  # DeepSpeed stores client_state beside its own keys
            return f"client_state key {k!r} is reserved for the checkpoint's own {k!r} entry"
    return None


def _prepare(save_dir: str, staging: str, client_state: Dict[str, Any], allow_pickle: bool,
             writes_uc_info: bool = False) -> bool:
    """Rank 0, phase 1. Returns whether client_state needs its own pickled file."""
    keys = _client_keys_problem(client_state, writes_uc_info)
    if keys:
        raise CheckpointError(f"save_checkpoint: {keys}")
    problem = plain_value_problem(client_state, "client_state")
    if problem and not allow_pickle:
        raise CheckpointError(f"save_checkpoint: {problem}; store tensors and JSON-like values "
                              "(they load with weights_only=True), or pass allow_pickle=True")
    ensure_writable_dir(save_dir)
    remove_tree(staging)  # left by an earlier crashed save of this tag
    try:
        os.makedirs(staging)
    except OSError as exc:
        raise CheckpointError(f"cannot create {staging}: {exc.strerror}") from None
    _step("staging-created")
    return problem is not None


def _link_tree(src: str, dst: str) -> None:
    """dst becomes a copy of directory src made of hard links (copies where links fail)."""
    os.makedirs(dst)
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_dir(follow_symlinks=False):
            _link_tree(entry.path, target)
            continue
        try:
            os.link(entry.path, target)
        except OSError:
            shutil.copy2(entry.path, target)


def _write_latest(save_dir: str, tag: str) -> None:
    write_bytes(os.path.join(save_dir, LATEST), tag.encode())
    fsync_dir(save_dir)


def _write_recovery_script(save_dir: str) -> None:
    """zero_to_fp32.py beside the tags, as DeepSpeed ships its own: consolidation without
    writing any code (it needs dslaunch installed, as DeepSpeed's needs DeepSpeed)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), RECOVERY_SCRIPT), "rb") as fh:
        script = fh.read()
    path = os.path.join(save_dir, RECOVERY_SCRIPT)
    write_bytes(path, script)
    make_executable(path)


def make_executable(path: str) -> None:
    """Add the execute bit to the recovery script. A file share that refuses permission
    changes (Azure Files, some NFS exports) costs only the bit: the script still runs with
    `python zero_to_fp32.py`, so the save goes on, with one line in the log."""
    try:
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    except (FileNotFoundError, PermissionError) as exc:
        logging.getLogger("dslaunch.runtime").info(
            f"save_checkpoint: could not make {path} executable ({exc}); run it with `python {RECOVERY_SCRIPT}`")


def _remove_leftovers(save_dir: str) -> None:
    keep = read_latest(save_dir)
    for entry in os.scandir(save_dir):
        if entry.name.startswith((STAGING, PREVIOUS, TRASH)) and entry.name != keep and entry.is_dir():
            remove_tree(entry.path)


def _commit(save_dir: str, staging: str, tag: str, save_latest: bool) -> None:
    final = os.path.join(save_dir, tag)
    previous = os.path.join(save_dir, PREVIOUS + tag)
    trash = os.path.join(save_dir, TRASH + tag)
    try:
        points_here = read_latest(save_dir) == tag
    except CheckpointError:
        points_here = False  # a broken `latest` is replaced below
    try:
        if os.path.exists(final):
            remove_tree(previous)
            remove_tree(trash)
            _link_tree(final, previous)
            fsync_dir(save_dir)
            _step("previous-linked")
            if points_here:
                _write_latest(save_dir, PREVIOUS + tag)
                _step("latest-to-previous")
            os.rename(final, trash)
            _step("old-moved-aside")
        os.rename(staging, final)
        fsync_dir(save_dir)
        _step("new-in-place")
        _write_recovery_script(save_dir)
        if save_latest or points_here:
            _write_latest(save_dir, tag)
            _step("latest-updated")
        _remove_leftovers(save_dir)
        _step("cleaned")
    except OSError as exc:
        raise CheckpointError(f"cannot commit checkpoint {final}: {exc.strerror or exc}") from None


def _buffer_names(module: torch.nn.Module) -> List[str]:
    """Persistent buffers, as DeepSpeed lists them (zero_to_fp32 takes buffers by these names)."""
    out = []
    for prefix, m in module.named_modules():
        for name, buf in m.named_buffers(recurse=False):
            if buf is not None and name not in m._non_persistent_buffers_set:
                out.append(f"{prefix}.{name}" if prefix else name)
    return out


def _frozen(module: torch.nn.Module) -> List[str]:
    seen, out = set(), []
    for name, p in module.named_parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(name)
    return out


def _dynamic_settings(scaler) -> Optional[Dict[str, Any]]:
    if scaler is None or not getattr(scaler, "dynamic", False):
        return None
    return {"factor": scaler.scale_factor, "window": scaler.scale_window, "min_scale": scaler.min_scale,
            "hysteresis": scaler.delayed_shift, "consecutive_hysteresis": scaler.consecutive_hysteresis}


def _fragment(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's ZeRO-3 chunk of a whole tensor (padded), as DeepSpeed keeps frozen parameters."""
    flat = full.detach().reshape(-1)
    chunk = -(-flat.numel() // world)
    padded = torch.zeros(chunk * world, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * chunk:(rank + 1) * chunk].clone()


def _param_shapes(shard: ShardState):
    """DeepSpeed's param_shapes: how the shard's kind lays each param group out (none when whole)."""
    kind, state = shard.layout.kind, shard.state
    if kind is ShardKind.PER_PARAMETER:
        return dsformat.stage3_param_shapes(state, shard.layout.sub_group_size)
    return dsformat.stage12_param_shapes(state) if kind is ShardKind.FLAT else None


def _whole_optimizer(run: Run, shard: ShardState) -> Dict[str, Any]:
    """DeepSpeed's "optimizer" entry for a whole (unsharded) state."""
    scaler = run.loss_scaler
    return dsformat.stage0_optimizer(shard.state, shard.param_groups, run.compute_dtype != torch.float32,
                                     scaler.state_dict() if scaler is not None else None, _dynamic_settings(scaler),
                                     run.global_steps, deepspeed_optimizer_of(run.config))


def _model_states(run: Run, module_state, shard: ShardState, client_state: Dict[str, Any],
                  exclude_frozen: bool = False) -> Dict[str, Any]:
    """DeepSpeed's model-states dict (engine._common_checkpoint_state plus client_state at the
    top level), with dslaunch's extras under "dslaunch". What the shard layout decides
    (frozen parameters, placeholders, the optimizer's place) comes from `shard.layout`;
    with exclude_frozen (DeepSpeed's exclude_frozen_parameters) the module state comes without
    frozen parameters and no frozen shapes or fragments are recorded, as in DeepSpeed."""
    module, lay = run.module, shard.layout
    place = run.place
    scaler = run.loss_scaler
    scaler_state = scaler.state_dict() if scaler is not None else None
    recorded = lay.frozen is not FrozenRecord.NONE and not exclude_frozen
    frozen = {n: module_state[n] for n in _frozen(module)} if recorded else {}
    if lay.module_in_shards:  # parameters live in the fp32 shards; DeepSpeed keeps empty placeholders
        params = dict(module.named_parameters(remove_duplicate=False))
        module_state = {k: (torch.empty(0, dtype=v.dtype) if k in params else v) for k, v in module_state.items()}
    layers = moe.moe_layers(module) if moe.uses_layout(module, lay) else []
    if layers:  # expert weights go to their own files (moe.py), as DeepSpeed's MoE layout
        module_state = moe.without_experts(module_state)
    autoep_layers = autoep.layers(module)
    if autoep_layers:  # AutoEP's stacked experts too, one file per expert (autoep.py)
        layers = autoep_layers
        module_state = autoep.without_experts(module_state, module)
    state = {
        "module": None if parallel.is_pipeline(run) else module_state,  # pipelines: one file per layer
        "buffer_names": _buffer_names(module),
        "optimizer": None if lay.sharded else _whole_optimizer(run, shard),
        "param_shapes": _param_shapes(shard),
        "frozen_param_shapes": OrderedDict((n, v.shape) for n, v in frozen.items()) if recorded else None,
        "shared_params": tied_aliases(module) if lay.records_tied else None,
        "frozen_param_fragments": (OrderedDict((n, v if lay.frozen is FrozenRecord.WHOLE
                                                else _fragment(v, lay.dp_size, lay.dp_rank))
                                               for n, v in frozen.items()) if recorded else None),
        "lr_scheduler": run.lr_scheduler.state_dict() if run.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": run.skipped_steps,
        "global_steps": run.global_steps,
        "global_samples": run.global_samples,
        "dp_world_size": place.dp_size,
        "mp_world_size": place.slices,  # DeepSpeed's grid: the (pipe, model) slice size
        "checkpoint_parallel_dimensions": {"pp_degree": place.pp_size, "tp_degree": place.mp_size},
        "ds_config": run.config.to_dict(),
        "ds_version": dsformat.DS_VERSION,
    }
    if layers:
        state["num_experts"] = [layer.num_experts for _, layer in layers]
    if autoep_layers:
        records = autoep.layer_records(module, run.expert_data_rank, run.expert_data_size)
        state[autoep.LAYERS_KEY] = records
        state["universal_checkpoint_info"] = {"universal_checkpoint_version": 0.4,
                                              "expert_parameter_patterns": [autoep.EXPERT_PATTERN],
                                              autoep.LAYERS_KEY: records}
    state.update(client_state)
    state["dslaunch"] = {"counters": run.counters, "loss_scaler": scaler_state,
                         "client_keys": sorted(client_state)}
    if not lay.sharded and shard.state is not None and "param_names" in shard.state:
        # every group's parameter names: another topology or stage re-cuts this state by name
        state["dslaunch"]["param_names"] = shard.state["param_names"]
    if place.mp_size > 1:
        # how each tensor-parallel shard sits in its full parameter: another tensor size re-cuts by it
        state["dslaunch"]["tensor_parallel_shards"] = tensor_slices.shard_specs(module)
    return state


def _write_rank_files(run: Run, staging: str, module_state, shard: ShardState, client_state: Dict[str, Any],
                      writes_shared: bool, exclude_frozen: bool = False) -> Dict[str, FileRecord]:
    """This rank's files: RNG states, its optimizer shard when sharded, and the model states
    (a partitioned module: every rank its own; otherwise one writer per (pipe, model) slice,
    parallel.py), with a pipeline stage's layer files. exclude_frozen leaves the frozen
    parameters out of every file that holds module weights."""
    rank, lay = run.global_rank, shard.layout
    if exclude_frozen:
        module_state = _without_frozen(run.module, module_state)
    records = {rng_states_name(rank): write_torch(os.path.join(staging, rng_states_name(rank)), rng_state())}
    if lay.sharded:
        scaler = run.loss_scaler
        scaler_state = scaler.state_dict() if scaler is not None else None
        dynamic = _dynamic_settings(scaler)
        optim = dsformat.zero_optim_states(
            shard.state, shard.param_groups, clip_grad=float(run.config.gradient_clipping),
            loss_scaler=loss_scaler_record(scaler_state, dynamic), dynamic_loss_scale=dynamic is not None,
            sub_group_size=lay.sub_group_size, ds_class=deepspeed_optimizer_of(run.config))
        name = parallel.optim_states_file(run)
        records[name] = write_torch(os.path.join(staging, name), {
            "optimizer_state_dict": optim, "ds_config": run.config.to_dict(), "ds_version": dsformat.DS_VERSION},
            deepspeed_objects=True)
    records.update(_write_moe_files(run, staging, module_state, shard))
    if lay.own_model_file or parallel.writes_model_states(run, writes_shared):
        name = parallel.zero_model_states_file(run) if lay.own_model_file else parallel.model_states_file(run)
        records[name] = write_torch(os.path.join(staging, name),
                                    _model_states(run, module_state, shard, client_state, exclude_frozen))
        for name, layer in parallel.layer_files(run, module_state).items():
            records[name] = write_torch(os.path.join(staging, name), layer)
    return records


def _write_moe_files(run: Run, staging: str, module_state, shard: ShardState) -> Dict[str, FileRecord]:
    """MoE layers (moe.py): the first rank of each expert-data-parallel group writes its
    experts' files and, with a whole (unsharded) optimizer state, its expert-parallel rank's
    optimizer file."""
    autoep_layout = autoep.uses_layout(run.module)
    if not moe.uses_layout(run.module, shard.layout) and not autoep_layout:
        return {}
    ep = run.expert_parallel_size
    if ep > 1 and run.config.checkpoint.use_node_local_storage:
        raise CheckpointError("save_checkpoint: checkpoint.use_node_local_storage with MoE ep_size > 1 is not "
                              "supported (a rank's experts are saved by a rank that may be on another node); "
                              "save to shared storage")
    first = run.expert_data_rank == 0
    if not first:
        return {}
    ep_rank = run.expert_rank if ep > 1 else 0
    records = {}
    files = autoep.expert_files(run.module) if autoep_layout else moe.expert_files(run.module, module_state,
                                                                                        ep_rank)
    for name, experts in files.items():
        records[name] = write_torch(os.path.join(staging, name), experts)
    if not shard.layout.sharded:
        name = moe.expp_file_name(ep_rank)
        records[name] = write_torch(os.path.join(staging, name), {
            "optimizer": _whole_optimizer(run, shard), "dslaunch": {"param_names": shard.state["param_names"]}})
    return records


def _agreed_tag(run: Run, tag) -> str:
    """Every rank's tag compared (checkpoint.tag_validation: Ignore, Warn or Fail, as in
    DeepSpeed); all ranks then save under rank 0's tag, so a mismatch can never split one
    checkpoint over several directories (DeepSpeed would write it half in each)."""
    wanted = str(tag) if tag is not None else f"global_step{run.global_steps}"
    tags = agree(None, wanted)
    mode = str(run.config.checkpoint.tag_validation).lower()
    differ = [f"rank {r} {t!r}" for r, t in enumerate(tags) if t != tags[0]]
    if differ and mode != "ignore":
        msg = (f"checkpoint tag differs across ranks: rank 0 {tags[0]!r}, {', '.join(differ[:3])}"
               f"{' ...' if len(differ) > 3 else ''}")
        if mode == "fail":
            raise TagMismatchError(msg + " (checkpoint.tag_validation: Fail)")
        if run.global_rank == 0:
            print(f"dslaunch: warning: {msg}; saving under rank 0's tag", file=sys.stderr, flush=True)
    return validate_tag(tags[0], "save_checkpoint tag")


def storage_leader(run: Run) -> int:
    """The rank that writes the files every rank shares (model states, manifest, latest) into
    the storage this rank writes to: rank 0, or with checkpoint.use_node_local_storage the
    node's local rank 0 (launchers number the ranks of a node consecutively)."""
    return run.global_rank - run.local_rank if run.config.checkpoint.use_node_local_storage else 0


def _without_frozen(module: torch.nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's exclude_frozen_parameters: the module state without the parameters that
    do not train (requires_grad False), under every name a shared one has; buffers stay."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def save(run: Run, save_dir: str, tag=None, client_state: Optional[Dict[str, Any]] = None, save_latest: bool = True,
         allow_pickle: bool = False, exclude_frozen_parameters: bool = False) -> str:
    save_dir = str(save_dir)
    tag = _agreed_tag(run, tag)
    client_state = dict(client_state) if client_state is not None else {}
    rank, strategy = run.global_rank, run.strategy
    leader = storage_leader(run)
    writes_shared = rank == leader
    staging = os.path.join(save_dir, STAGING + tag)

    # 1. the directory is checked before any state is gathered
    error, pickled = None, False
    if writes_shared:
        try:
            pickled = _prepare(save_dir, staging, client_state, allow_pickle,
                               writes_uc_info=bool(autoep.layers(run.module)))
        except CheckpointError as exc:
            error = str(exc)
    agree(error)

    # 2. every rank writes its files
    module_state = strategy.module_state_dict()  # collective under ZeRO-3
    shard = strategy.shard_state()
    records: Dict[str, FileRecord] = {}
    error = None
    try:
        records.update(_write_rank_files(run, staging, module_state, shard,
                                         {} if pickled else client_state, writes_shared, exclude_frozen_parameters))
        if writes_shared and pickled:
            records[CLIENT_STATE_FILE] = write_torch(os.path.join(staging, CLIENT_STATE_FILE), client_state)
        _step("files-written")
    except CheckpointError as exc:
        error = str(exc)
    layout = shard.layout
    del module_state, shard
    all_records = agree(error, (leader, records), on_failure=lambda: writes_shared and remove_tree(staging))

    # 3. each storage leader writes the manifest of the files in its storage and commits
    error = None
    if writes_shared:
        try:
            files: Dict[str, FileRecord] = {}
            for r_leader, r_files in all_records:
                if r_leader == leader:
                    files.update(r_files)
            manifest = Manifest(tag=tag, world_size=run.world_size, zero_stage=layout.zero_stage,
                                sharded_optimizer_state=layout.sharded, files=files,
                                pickled_client_state=pickled, node_local=leader != 0 or any(
                                    r_leader != 0 for r_leader, _ in all_records),
                                **parallel.manifest_fields(run))
            write_bytes(os.path.join(staging, "manifest.json"), manifest.to_json().encode())
            fsync_dir(staging)
            _step("manifest-written")
            _commit(save_dir, staging, tag, save_latest)
        except CheckpointError as exc:
            remove_tree(staging)
            error = str(exc)
    agree(error)
    return os.path.join(save_dir, tag)
