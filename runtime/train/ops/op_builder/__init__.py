"""`deepspeed.ops.op_builder`: DeepSpeed's op builders, answering for dslaunch's kernels.

Scripts and DeepSpeed's own tests ask a builder whether its op can run here
(`CPUAdamBuilder().is_compatible()`) before using the optimizer built on it. The answer is
the truth about dslaunch's kernel of the same job (dslaunch.kernels): asking builds it (or
loads the cached build), so True means the op is loaded. Ops dslaunch has no kernel for
(fused CUDA LAMB and Lion, DeepSpeed's libaio) answer False. `load()` returns dslaunch's
kernel module, whose functions are dslaunch's own, not DeepSpeed's C++ bindings.
"""
from __future__ import annotations

import importlib
from typing import Callable, Optional


class OpBuilder:
    NAME = "op"
    _module: Optional[str] = None  # dslaunch.kernels.<module>
    _probe: Optional[str] = None  # its function answering "loaded?"
    _why_not = "dslaunch has no kernel for this op"

    def __init__(self, name: Optional[str] = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"dslaunch.kernels.{self._module}" if self._module else f"deepspeed.ops.{self.name}_op"

    def _available(self) -> bool:
        if self._module is None:
            return False
        probe: Callable[[], bool] = getattr(importlib.import_module(f"dslaunch.kernels.{self._module}"), self._probe)
        return bool(probe())

    def is_compatible(self, verbose: bool = False) -> bool:
        return self._available()

    def load(self, verbose: bool = True):
        if not self._available():
            raise RuntimeError(f"{type(self).__name__}: the {self.name} op cannot run here ({self._why_not})")
        return importlib.import_module(f"dslaunch.kernels.{self._module}")


class CPUAdamBuilder(OpBuilder):
    NAME, _module, _probe = "cpu_adam", "cpu_adam", "cpu_adam_available"
    _why_not = "its build failed; `dslaunch build-ops` shows the compiler's error"


class CPUAdagradBuilder(OpBuilder):
    NAME, _module, _probe = "cpu_adagrad", "cpu_adagrad", "cpu_adagrad_available"
    _why_not = "its build failed; `dslaunch build-ops` shows the compiler's error"


class CPULionBuilder(OpBuilder):
    NAME, _module, _probe = "cpu_lion", "cpu_lion", "cpu_lion_available"
    _why_not = "its build failed; `dslaunch build-ops` shows the compiler's error"


class FusedAdamBuilder(OpBuilder):
    """With a GPU, the fused CUDA op; without one, the CPU Adam op, which steps FusedAdam's CPU
    parameters (as DeepSpeed's CPU accelerator answers with its CPU build of FusedAdam)."""

    NAME, _module, _probe = "fused_adam", "fused_adam", "fused_adam_available"
    _why_not = "it needs nvcc with a GPU, or the CPU Adam op without one"

    def _available(self) -> bool:
        import torch

        if torch.cuda.is_available():
            return super()._available()
        from dslaunch.kernels.cpu_adam import cpu_adam_available

        return cpu_adam_available()


class FusedLambBuilder(OpBuilder):
    NAME = "fused_lamb"
    _why_not = "dslaunch's Lamb runs on torch ops (dslaunch.kernels.Lamb), with no fused CUDA kernel"


class FusedLionBuilder(OpBuilder):
    NAME = "fused_lion"
    _why_not = "dslaunch's Lion runs on torch ops (dslaunch.kernels.Lion), with no fused CUDA kernel"


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    _why_not = "NVMe offload reads and writes through torch's file I/O, not DeepSpeed's libaio op"


class PinMemoryBuilder(OpBuilder):
    NAME = "pin_memory"
    _why_not = ("host memory is pinned with torch's pin_memory(); DeepSpeed's native mlock allocator "
                "(DS_PIN_MEMORY_BACKEND=native) is not provided")


def cast_to_byte_tensor(tensors):
    """The bytes of a contiguous tensor (or of each of a list) as a flat uint8 view of the same
    memory, as DeepSpeed's utils op returns them."""
    import torch

    if isinstance(tensors, (list, tuple)):
        return [cast_to_byte_tensor(t) for t in tensors]
    if not tensors.is_contiguous():
        raise ValueError("cast_to_byte_tensor: the tensor must be contiguous (its bytes are viewed, not copied)")
    return tensors.reshape(-1).view(torch.uint8)


class QuantizerBuilder(OpBuilder):
    NAME = "quantizer"
    _why_not = "dslaunch has no quantizer kernel (ZeRO++'s quantized weights and gradients are refused in the config)"


class UtilsBuilder(OpBuilder):
    """flatten/unflatten of tensor lists, which torch provides, and the byte view of tensors."""

    NAME = "utils"

    def _available(self) -> bool:
        return True

    def load(self, verbose: bool = True):
        from types import SimpleNamespace

        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        return SimpleNamespace(flatten=_flatten_dense_tensors, unflatten=_unflatten_dense_tensors,
                               cast_to_byte_tensor=cast_to_byte_tensor)


ALL_OPS = {b.NAME: b() for b in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder,
                                 FusedLambBuilder, FusedLionBuilder, AsyncIOBuilder, PinMemoryBuilder, QuantizerBuilder,
                                 UtilsBuilder)}

__all__ = ["OpBuilder", "CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "FusedAdamBuilder",
           "FusedLambBuilder", "FusedLionBuilder", "AsyncIOBuilder", "PinMemoryBuilder", "QuantizerBuilder",
           "UtilsBuilder", "ALL_OPS"]
