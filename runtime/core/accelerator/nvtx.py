"""deepspeed.utils.nvtx: instrument_w_nvtx, the decorator that shows a function's calls as named
ranges in a profiler's timeline (Nsight reads NVTX ranges), through the accelerator's
range_push/range_pop (CUDA's NVTX; nothing on the CPU).

The range is named after the function's __qualname__. An accelerator that says
`supports_nvtx_domain` gets DEEPSPEED_NVTX_DOMAIN as the domain, others (ours) a plain range.
Nothing is recorded while `enable_nvtx` is False or while torch.compile traces (a range push is
a graph break). The module's names are read at each call, so a script (or a test) may switch
`enable_nvtx` off or replace `get_accelerator` and `is_compiling` here. Unlike DeepSpeed 0.19.8,
on purpose: a function that raises still closes its range (the profiler's ranges stay nested),
and the wrapper carries the function's name and docstring (functools.wraps).
"""
import functools

import torch

# torch.compiler.is_compiling arrived in torch 2.3; dynamo's own answer before that
is_compiling = getattr(torch.compiler, "is_compiling", None) or torch._dynamo.is_compiling

from .real_accelerator import get_accelerator

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"


def _push(accelerator, msg: str):
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_push(msg, domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_push(msg)


def _pop(accelerator):
    if getattr(accelerator, "supports_nvtx_domain", False):
        return accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    return accelerator.range_pop()


def instrument_w_nvtx(func):
    """`func` wrapped in a profiler range named after it (see the module's docstring)."""

    @functools.wraps(func)
    def wrapped_fn(*args, **kwargs):
        if not enable_nvtx or is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        _push(accelerator, func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            _pop(accelerator)

    return wrapped_fn


__all__ = ["instrument_w_nvtx", "enable_nvtx", "DEEPSPEED_NVTX_DOMAIN"]
