"""Floating tensors created inside zero.Init take Init's dtype at creation, as in DeepSpeed.

DeepSpeed 0.19.8's Init replaces torch.tensor, empty, zeros, ones, full, arange, eye and
randn, for the length of the context, with versions that convert any floating result to its
target dtype. So `nn.Linear` under a bf16 Init makes its weight in bf16 and `reset_parameters`
samples it there: `uniform_` on a bf16 tensor does not give the values of fp32 sampling
rounded afterwards (at the bound of the range the rounding can flip the sign). To give
DeepSpeed's weights, the same eight functions are intercepted here, with torch's own hook
for that (a TorchFunctionMode, the mechanism behind `with torch.device(...)`), instead of
rebinding attributes of the torch module.

Pure of any process group: zero.Init (params.py) enters it, and pauses every such mode
around its own partitioning and gathering, whose buffers keep the dtypes they are given.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

# DeepSpeed's list (partition_parameters.py, the constructors Init wraps)
FACTORIES = frozenset({torch.tensor, torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.eye,
                       torch.randn})


class CreateInDtype(TorchFunctionMode):
    """While active, a floating tensor returned by one of FACTORIES is converted to `dtype`
    in place of its data (the same tensor object, so requires_grad and identity hold, as
    DeepSpeed's `tensor.data = tensor.data.to(dtype)`)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (not _paused[0] and func in FACTORIES and isinstance(out, torch.Tensor) and out.is_floating_point()
                and out.dtype != self.dtype):
            out.data = out.data.to(self.dtype)
        return out


_paused = [0]  # how many paused() blocks are open (one count for every mode: nested Init contexts)


@contextlib.contextmanager
def paused():
    """Tensors created here keep the dtype their code asks for (zero.Init's own machinery)."""
    _paused[0] += 1
    try:
        yield
    finally:
        _paused[0] -= 1
