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

import os
import shutil
import sys
from typing import Any, Callable, Dict, Optional

from .agree import agree
from .errors import CheckpointError
from .files import FileRecord, ensure_writable_dir, fsync_dir, plain_value_problem, remove_tree, write_bytes, \
    write_torch
from .layout import LATEST, PREVIOUS, STAGING, TRASH, read_latest, rng_states_name, validate_tag
from .manifest import Manifest
from .rng import rng_state
from . import parallel

CLIENT_STATE_FILE = "client_state.pt"  # only with allow_pickle=True and objects that need pickle

_crash_hook: Callable[[str], None] = lambda step: None


def _step(name: str) -> None:
    _crash_hook(name)


def _client_state_problem(client_state: Dict[str, Any]) -> Optional[str]:
    if not isinstance(client_state, dict):
        return f"client_state must be a dict, not {type(client_state).__name__}"
    for k in client_state:
        if not isinstance(k, str):
            return f"client_state key {k!r} is not a string"
    return plain_value_problem(client_state, "client_state")


def _prepare(save_dir: str, staging: str, client_state: Dict[str, Any], allow_pickle: bool) -> bool:
    """Rank 0, phase 1. Returns whether client_state needs its own pickled file."""
    problem = _client_state_problem(client_state)
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
        if save_latest or points_here:
            _write_latest(save_dir, tag)
            _step("latest-updated")
        _remove_leftovers(save_dir)
        _step("cleaned")
    except OSError as exc:
        raise CheckpointError(f"cannot commit checkpoint {final}: {exc.strerror or exc}") from None


def _model_states(engine, module_state, optim_state, client_state: Dict[str, Any]) -> Dict[str, Any]:
    strategy = engine.strategy
    return {
        "module": None if parallel.is_pipeline(engine) else module_state,  # pipelines: one file per layer
        "optimizer": None if strategy.sharded_optimizer_state else optim_state,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "counters": engine.counters_state(),
        "client_state": client_state,
        "ds_config": engine.config.to_dict(),
        "dp_world_size": parallel.placement(engine).dp_size,
        "zero_stage": strategy.stage,
    }


def _agreed_tag(engine, tag) -> str:
    """Every rank's tag compared (checkpoint.tag_validation: Ignore, Warn or Fail, as in
    DeepSpeed); all ranks then save under rank 0's tag, so a mismatch can never split one
    checkpoint over several directories (DeepSpeed would write it half in each)."""
    wanted = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    tags = agree(None, wanted)
    mode = str(engine.config.checkpoint.tag_validation).lower()
    differ = [f"rank {r} {t!r}" for r, t in enumerate(tags) if t != tags[0]]
    if differ and mode != "ignore":
        msg = (f"checkpoint tag differs across ranks: rank 0 {tags[0]!r}, {', '.join(differ[:3])}"
               f"{' ...' if len(differ) > 3 else ''}")
        if mode == "fail":
            raise CheckpointError(msg + " (checkpoint.tag_validation: Fail)")
        if engine.global_rank == 0:
            print(f"dslaunch: warning: {msg}; saving under rank 0's tag", file=sys.stderr, flush=True)
    return validate_tag(tags[0], "save_checkpoint tag")


def storage_leader(engine) -> int:
    """The rank that writes the files every rank shares (model states, manifest, latest) into
    the storage this rank writes to: rank 0, or with checkpoint.use_node_local_storage the
    node's local rank 0 (launchers number the ranks of a node consecutively)."""
    return engine.global_rank - engine.local_rank if engine.config.checkpoint.use_node_local_storage else 0


def save(engine, save_dir: str, tag=None, client_state: Optional[Dict[str, Any]] = None, save_latest: bool = True,
         allow_pickle: bool = False) -> str:
    save_dir = str(save_dir)
    tag = _agreed_tag(engine, tag)
    client_state = dict(client_state) if client_state is not None else {}
    rank, strategy = engine.global_rank, engine.strategy
    leader = storage_leader(engine)
    writes_shared = rank == leader
    staging = os.path.join(save_dir, STAGING + tag)

    # 1. the directory is checked before any state is gathered
    error, pickled = None, False
    if writes_shared:
        try:
            pickled = _prepare(save_dir, staging, client_state, allow_pickle)
        except CheckpointError as exc:
            error = str(exc)
    agree(error)

    # 2. every rank writes its files
    module_state = strategy.module_state_dict()  # collective under ZeRO-3
    optim_state = strategy.optimizer_state_dict()
    records: Dict[str, FileRecord] = {}
    error = None
    try:
        records[rng_states_name(rank)] = write_torch(os.path.join(staging, rng_states_name(rank)), rng_state())
        if strategy.sharded_optimizer_state:
            name = parallel.optim_states_file(engine)
            records[name] = write_torch(os.path.join(staging, name), optim_state)
        if parallel.writes_model_states(engine, writes_shared):  # one writer per (pipe, model) slice
            saved_client = {} if pickled else client_state
            name = parallel.model_states_file(engine)
            records[name] = write_torch(os.path.join(staging, name),
                                        _model_states(engine, module_state, optim_state, saved_client))
            for name, layer in parallel.layer_files(engine, module_state).items():
                records[name] = write_torch(os.path.join(staging, name), layer)
        if writes_shared:
            if pickled:
                records[CLIENT_STATE_FILE] = write_torch(os.path.join(staging, CLIENT_STATE_FILE), client_state)
        _step("files-written")
    except CheckpointError as exc:
        error = str(exc)
    del module_state, optim_state
    all_records = agree(error, (leader, records), on_failure=lambda: writes_shared and remove_tree(staging))

    # 3. each storage leader writes the manifest of the files in its storage and commits
    error = None
    if writes_shared:
        try:
            files: Dict[str, FileRecord] = {}
            for r_leader, r_files in all_records:
                if r_leader == leader:
                    files.update(r_files)
            manifest = Manifest(tag=tag, world_size=engine.world_size, zero_stage=strategy.stage,
                                sharded_optimizer_state=strategy.sharded_optimizer_state, files=files,
                                pickled_client_state=pickled, node_local=leader != 0 or any(
                                    r_leader != 0 for r_leader, _ in all_records),
                                **parallel.manifest_fields(engine))
            write_bytes(os.path.join(staging, "manifest.json"), manifest.to_json().encode())
            fsync_dir(staging)
            _step("manifest-written")
            _commit(save_dir, staging, tag, save_latest)
        except CheckpointError as exc:
            remove_tree(staging)
            error = str(exc)
    agree(error)
    return os.path.join(save_dir, tag)
