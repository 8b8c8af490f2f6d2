"""DeepSpeed's AutoTP entry points for scripts: set_autotp_mode and tp_model_init.

In DeepSpeed 0.19 `deepspeed.tp_model_init(model, tp_size, dtype, config=None, tp_group=None)`
shards nothing: it records its arguments (a second call must agree), switches AutoTP to
training mode and returns the model; `deepspeed.initialize` then merges the record into the
config's `tensor_parallel` section (`merge_tp_model_init_into_config`) and shards there. The
Hugging Face Trainer calls it this way. dslaunch keeps that contract, so a model is never
sharded twice.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from ..core import comm
from .shard import TensorParallelError


class AUTOTP_MODE(enum.Enum):  # noqa: N801 - DeepSpeed's name
    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


_mode = AUTOTP_MODE.INFERENCE


def set_autotp_mode(training: bool = False) -> None:
    """deepspeed.module_inject.set_autotp_mode: AutoTP's layers are for training or inference."""
    global _mode
    _mode = AUTOTP_MODE.TRAINING if training else AUTOTP_MODE.INFERENCE


def get_autotp_mode() -> AUTOTP_MODE:
    return _mode


def is_autotp_training_mode() -> bool:
    return _mode is AUTOTP_MODE.TRAINING


@dataclass(frozen=True)
class TPModelInitArgs:
    tp_size: int
    dtype: torch.dtype
    tp_group: Any = None


_recorded: Optional[TPModelInitArgs] = None


def _group_size(group: Any) -> Optional[int]:
    return comm.get_world_size(group) if group is not None and comm.is_initialized() else None


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None,
                  **kwargs: Any) -> torch.nn.Module:
    """deepspeed.tp_model_init: record (tp_size, dtype, tp_group) for deepspeed.initialize, set
    AutoTP's training mode, and return `model` unchanged (DeepSpeed 0.19's contract). `config`
    is taken and not read, as in DeepSpeed (the Hugging Face Trainer passes it; the config that
    counts is the one deepspeed.initialize gets)."""
    global _recorded
    unknown = sorted(set(kwargs) - {"tp_group"})
    if unknown:
        raise TensorParallelError(f"tp_model_init: unexpected argument {unknown[0]!r} (known: tp_group)")
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise TensorParallelError(f"tp_model_init: tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(dtype, torch.dtype):
        raise TensorParallelError(f"tp_model_init: dtype must be a torch.dtype, got {dtype!r}")
    group = kwargs.get("tp_group")
    size = _group_size(group)
    if size is not None and size != tp_size:
        raise TensorParallelError(f"tp_model_init: tp_size ({tp_size}) does not match tp_group size ({size})")
    new = TPModelInitArgs(tp_size, dtype, group)
    if _recorded is not None:
        old = _recorded
        if old.tp_size != tp_size or old.dtype != dtype or (old.tp_group is None) != (group is None) \
                or _group_size(old.tp_group) != size:
            raise TensorParallelError(f"tp_model_init: called again with tp_size={tp_size}, dtype={dtype} after "
                                      f"tp_size={old.tp_size}, dtype={old.dtype} (conflicting arguments)")
    else:
        _recorded = new
    set_autotp_mode(training=True)
    return model


def recorded_tp_model_init() -> Optional[TPModelInitArgs]:
    """What tp_model_init recorded in this process, or None."""
    return _recorded


def forget_tp_model_init() -> None:
    global _recorded
    _recorded = None


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def merge_tp_model_init_into_config(config: Dict[str, Any], mpu: Any = None) -> Dict[str, Any]:
    """DeepSpeed's merge of tp_model_init's record into a config dict (changed in place and
    returned) for deepspeed.initialize: the config's values win, missing ones are filled from
    the record, and a disagreement is one TensorParallelError line. A recorded tp_group goes to
    tensor_parallel.tp.tp_group (and excludes `mpu`)."""
    rec = _recorded
    if rec is None:
        return config
    if rec.tp_group is not None and mpu is not None:
        raise TensorParallelError("tp_model_init was given a tp_group; deepspeed.initialize must not also get mpu")
    section = config.setdefault("tensor_parallel", {})
    if not isinstance(section, dict):
        raise TensorParallelError("tensor_parallel must be a dict")
    autotp = section.get("autotp_size")
    if autotp is not None and autotp != rec.tp_size:
        raise TensorParallelError(f"tensor_parallel.autotp_size is {autotp} in the config but tp_model_init was "
                                  f"given tp_size={rec.tp_size}")
    section["autotp_size"] = rec.tp_size
    tp = section.get("tp") or {}
    if not isinstance(tp, dict):
        raise TensorParallelError("tensor_parallel.tp must be a dict when given")
    if tp.get("tp_size") is not None and tp["tp_size"] != rec.tp_size:
        raise TensorParallelError(f"tensor_parallel.tp.tp_size is {tp['tp_size']} in the config but tp_model_init "
                                  f"was given tp_size={rec.tp_size}")
    tp["tp_size"] = rec.tp_size
    if rec.tp_group is not None:
        if tp.get("tp_group") is not None and tp["tp_group"] is not rec.tp_group:
            raise TensorParallelError("tensor_parallel.tp.tp_group differs from the tp_group given to tp_model_init")
        tp["tp_group"] = rec.tp_group
    section["tp"] = tp
    for key, want in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        sub = config.get(key)
        if isinstance(sub, dict) and sub.get("enabled") is True and rec.dtype != want:
            raise TensorParallelError(f"{key} is enabled in the config but tp_model_init was given dtype {rec.dtype}")
    dt = section.get("dtype")
    if dt is not None:
        value = _DTYPES.get(dt.lower()) if isinstance(dt, str) else dt
        if value is not None and value != rec.dtype:
            raise TensorParallelError(f"tensor_parallel.dtype is {dt} in the config but tp_model_init was given "
                                      f"dtype {rec.dtype}")
    return config
