"""The CPU optimizer kernels as torch ops: finding a loaded library's ops and giving them
fake implementations.

Each build registers its ops under a namespace of its own (builder.py says why), which the
library names through `ds_cpu_<op>_namespace()`; `torch.ops.<namespace>.adam_step` is then
the op. The C++ side checks every tensor; the fake implementation (what torch.compile and
FakeTensor tracing run instead of the kernel) runs the same checks in Python on the fake
tensors, so a bad argument fails at trace time with the same kind of message, and returns
nothing: the ops only mutate their arguments, which the schema declares (Tensor(a!)[]).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch


def register(lib: ctypes.CDLL, prefix: str, name: str, fake: Callable[..., None]):
    """The op `name` of the library whose C entry points start with `prefix`, with `fake`
    registered as its fake implementation (once per namespace)."""
    getter = getattr(lib, f"{prefix}_namespace")
    getter.restype = ctypes.c_char_p
    namespace = getter().decode()
    qualified = f"{namespace}::{name}"
    if qualified not in _FAKES:
        torch.library.register_fake(qualified)(fake)
        _FAKES.add(qualified)
    return getattr(getattr(torch.ops, namespace), name).default


_FAKES: set = set()
