"""DeepSpeed's `deepspeed.runtime.torch_autocast`: which dtype a parameter's gradients are
reduced in, and the forward's autocast context.

DeepSpeed 0.19.8 marks the parameters of "lower precision safe" modules (Linear, Conv1d-3d by
default) with a `comm_dtype` attribute when `torch_autocast` is enabled, and reduces their
gradients in the autocast dtype. dslaunch reduces every gradient in the parameter's own dtype
(fp32 under torch_autocast: more precise than DeepSpeed, at twice the bytes on the wire), so it
marks no parameter: `has_comm_dtype` is False and `get_comm_dtype` is the parameter's dtype,
which is what the engine really sends. The config's `torch_autocast.lower_precision_safe_modules`
is refused for the same reason (core/config/precision.py). DeepSpeed's engine-internal calls
(`init_autocast_params`, `is_autocast_initialized`, `get_autocast_dtype`) are not provided: the
engine's precision policy (core/precision.py) says the autocast dtype (`engine.precision.autocast`).
"""
from __future__ import annotations

import contextlib
from typing import Iterable, List, Set

import torch

from .precision import forward_context

# DeepSpeed's default lower-precision-safe classes, named for configs that list them
LOWER_PRECISION_SAFE_MODULES = [torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d]
PARAM_COMM_DTYPE_ATTR_NAME = "comm_dtype"


def get_default_autocast_lower_precision_modules() -> List[str]:
    return [f"{cls.__module__}.{cls.__name__}" for cls in LOWER_PRECISION_SAFE_MODULES]


def has_comm_dtype(param: torch.Tensor) -> bool:
    """Whether `param` is reduced in a dtype other than its own (never, in dslaunch)."""
    return hasattr(param, PARAM_COMM_DTYPE_ATTR_NAME)


def get_comm_dtype(param: torch.Tensor) -> torch.dtype:
    return getattr(param, PARAM_COMM_DTYPE_ATTR_NAME, param.dtype)


def get_all_comm_dtypes(params: Iterable[torch.Tensor]) -> Set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> List[torch.dtype]:
    """A fixed order for per-dtype buckets, the same on every rank (by name)."""
    return sorted(dtypes, key=str)


@contextlib.contextmanager
def autocast_if_enabled(engine):
    """The context the engine runs its forward in (core/precision.py `forward_context`): the
    config's autocast when `torch_autocast.enabled`, replacing a caller's own; autocast off
    inside when the caller's autocast is on and the config's is not."""
    with forward_context(engine.precision, engine.device):
        yield
