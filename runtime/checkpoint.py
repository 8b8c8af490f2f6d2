"""Atomic checkpoints: save_dir/<tag>/ plus save_dir/latest.

Layout of one tag:
    mp_rank_00_model_states.pt   rank 0: module, scheduler, loss scaler, counters, client_state,
                                 and the optimizer state when the strategy does not shard it
    zero_pp_rank_<r>_mp_rank_00_optim_states.pt   every rank, when the strategy shards it
    rng_state_rank_<r>.pt        every rank: torch / python (/ numpy / cuda) RNG states
    manifest.json                rank 0, written last: files, sizes, world size, stage

Atomicity: everything is written into save_dir/.tmp.<tag>/ (each file itself via a
.part name and os.replace), the manifest last; only then does rank 0 rename the folder to
<tag> and replace `latest` (again via a temporary name). A crash at any point leaves the
previous tag and `latest` as they were. Loading checks the manifest and reads every file
before changing any state, so a missing or damaged checkpoint raises CheckpointError and
loads nothing.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

MODEL_FILE = "mp_rank_00_model_states.pt"
MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    pass


def optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_rank_{rank}.pt"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, obj: Any) -> None:
    part = path + ".part"
    with open(part, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def _write_text_atomic(path: str, text: str) -> None:
    part = path + ".part"
    with open(part, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(part, path)


def rng_state() -> Dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(engine, save_dir: str, tag: Optional[str], client_state: Optional[Dict[str, Any]]) -> str:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith("."):
        raise CheckpointError(f"save_checkpoint: invalid tag {tag!r}")
    rank, strategy = engine.global_rank, engine.strategy
    tmp = os.path.join(save_dir, f".tmp.{tag}")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier crashed save
        os.makedirs(tmp)
    _barrier()
    module_state = strategy.module_state_dict()
    optim_state = strategy.optimizer_state_dict()
    _write_atomic(os.path.join(tmp, rng_file(rank)), rng_state())
    if strategy.sharded_optimizer_state:
        _write_atomic(os.path.join(tmp, optim_file(rank)), optim_state)
    if rank == 0:
        model = {
            "module": module_state,
            "optimizer": None if strategy.sharded_optimizer_state else optim_state,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "counters": engine.counters_state(),
            "client_state": dict(client_state or {}),
            "ds_config": engine.config.to_dict(),
            "dp_world_size": engine.world_size,
            "zero_stage": strategy.stage,
        }
        _write_atomic(os.path.join(tmp, MODEL_FILE), model)
    _barrier()
    if rank == 0:
        files = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        manifest = {"tag": tag, "world_size": engine.world_size, "zero_stage": strategy.stage,
                    "sharded_optimizer_state": strategy.sharded_optimizer_state, "files": files}
        _write_text_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
        _fsync_dir(tmp)
        final = os.path.join(save_dir, tag)
        old = os.path.join(save_dir, f".old.{tag}")
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(save_dir)
        _write_text_atomic(os.path.join(save_dir, LATEST), tag)
        _fsync_dir(save_dir)
    _barrier()
    return os.path.join(save_dir, tag)


def _read_manifest(path: str) -> Dict[str, Any]:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with open(mpath) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        raise CheckpointError(f"checkpoint {path} is incomplete or damaged: {MANIFEST} is missing or unreadable") from None
    for name, size in manifest.get("files", {}).items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath) or os.path.getsize(fpath) != size:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing or has the wrong size")
    return manifest


def _load_file(path: str, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as exc:  # any unpickling failure means a damaged file
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from None


def _check_module_state(module: torch.nn.Module, state: Dict[str, torch.Tensor], path: str) -> None:
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    for k, v in own.items():
        if tuple(v.shape) != tuple(state[k].shape):
            raise CheckpointError(f"checkpoint {path}: {k} has shape {tuple(state[k].shape)}, "
                                  f"the model has {tuple(v.shape)}")


def load(engine, load_dir: str, tag: Optional[str], load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False) -> Tuple[str, Dict[str, Any]]:
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        try:
            with open(latest) as fh:
                tag = fh.read().strip()
        except OSError:
            raise CheckpointError(f"no checkpoint to resume: {latest} does not exist (pass tag= to choose one)") from None
    path = os.path.join(load_dir, str(tag))
    manifest = _read_manifest(path)
    rank, strategy = engine.global_rank, engine.strategy
    # Strategies with loads_any_world_size (stage 0 and ZeRO) re-cut shards saved at any world size
    # or stage (runtime/zero/checkpoint.py): they get every saved rank's file, memory-mapped so
    # only the overlapping pieces are read.
    reshard = (manifest["sharded_optimizer_state"] and getattr(strategy, "loads_any_world_size", False)
               and (manifest["world_size"] != engine.world_size or manifest["zero_stage"] != strategy.stage))
    if manifest["sharded_optimizer_state"] and manifest["world_size"] != engine.world_size and load_optimizer_states \
            and not reshard:
        raise CheckpointError(f"checkpoint {path} holds optimizer state sharded over {manifest['world_size']} ranks; "
                              f"this job has {engine.world_size} (consolidate it or load with load_optimizer_states=False)")
    # Read everything first: nothing is applied until every file has been read.
    model = _load_file(os.path.join(path, MODEL_FILE))
    if strategy.stage != 3:  # stage 3's live module holds partitions, not full tensors
        _check_module_state(engine.module, model["module"], path)
    optim = None
    if load_optimizer_states and not load_module_only:
        if reshard:
            optim = [_load_file(os.path.join(path, optim_file(r)), mmap=True) for r in range(manifest["world_size"])]
        else:
            optim = (_load_file(os.path.join(path, optim_file(rank))) if manifest["sharded_optimizer_state"]
                     else model["optimizer"])
    rng_path = os.path.join(path, rng_file(rank))
    rng = _load_file(rng_path) if os.path.exists(rng_path) and not load_module_only else None

    strategy.load_module_state_dict(model["module"])
    if load_module_only:
        return path, model.get("client_state", {})
    if optim is not None:
        strategy.load_optimizer_state_dict(optim)
    if load_lr_scheduler_states and engine.lr_scheduler is not None and model["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
    if engine.loss_scaler is not None and model["loss_scaler"] is not None:
        engine.loss_scaler.load_state_dict(model["loss_scaler"])
    engine.load_counters_state(model["counters"])
    if rng is not None:
        set_rng_state(rng)
    return path, model.get("client_state", {})
