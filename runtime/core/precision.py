"""What the engine does to a forward's inputs and context for mixed precision.

- `fp16.auto_cast`: floating-point tensors among the inputs (nested in lists, tuples and
  dicts) are cast to fp16, as DeepSpeed does.
- `torch_autocast.enabled`: the forward runs under `torch.autocast(dtype=...)`.
- A forward that fails because a float32 input met the model's fp16/bf16 weights is
  reported as one line naming the fix instead of a deep traceback from inside the model.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

from .strict import ConfigError


class InputDtypeError(ConfigError):
    """A forward input whose dtype does not match the model's compute dtype."""


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [cast_floating(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype)) for k, v in value.items())
    return value


def forward_context(config, device: torch.device):
    ac = config.torch_autocast
    if not ac.enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=ac.torch_dtype)


def _floats(values: Iterable[Any]):
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                yield v
        elif isinstance(v, (list, tuple)):
            yield from _floats(v)
        elif isinstance(v, dict):
            yield from _floats(v.values())


_DTYPE_WORDS = ("dtype", "Half", "BFloat16", "Float", "scalar type")
_KEYS = {torch.float16: "fp16.enabled", torch.bfloat16: "bf16.enabled"}


def explain_dtype_error(exc: RuntimeError, compute_dtype: torch.dtype, args, kwargs) -> None:
    """Raise InputDtypeError when `exc` comes from float32 inputs meeting 16-bit weights."""
    if compute_dtype not in _KEYS or not any(w in str(exc) for w in _DTYPE_WORDS):
        return
    wrong = sorted({str(t.dtype).replace("torch.", "") for t in _floats(list(args) + list(kwargs.values()))
                    if t.dtype != compute_dtype})
    if not wrong:
        return
    name = str(compute_dtype).replace("torch.", "")
    hint = ' or set "fp16": {"auto_cast": true}' if compute_dtype == torch.float16 else ""
    raise InputDtypeError(
        f"{_KEYS[compute_dtype]}: the model runs in {name} but engine(...) got {', '.join(wrong)} inputs; cast them "
        f"first, e.g. x.to(engine.device, {compute_dtype}){hint} (the model said: {str(exc).splitlines()[0]})"
    ) from None
