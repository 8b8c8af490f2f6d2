"""The int8 dequantisation paths: our C++ kernel for decode shapes on the CPU, a torch op otherwise.

`int8_matmul(x, q, scales, group, dtype)` computes x @ (q * scales)^T. With fp32 activations
on the CPU and at most MAX_ROWS rows (decoding), it calls int8_linear.cpp (built by
dslaunch.kernels' builder for this CPU's instruction set), which reads each int8 weight once;
otherwise (prefill, GPUs, half-precision activations) the weight is dequantised by a torch op
and multiplied by torch. DSLAUNCH_INT8_KERNEL=0 forces the torch op (for A/B measurements). If
the kernel cannot be built, the torch op is used with one warning naming the compiler error.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ...kernels import builder
from ...kernels.loader import LazyOp
from .quantize import dequantize_int8

SOURCE = Path(__file__).resolve().with_name("int8_linear.cpp")
MAX_ROWS = 16  # beyond this the matmul is compute-bound and torch's GEMM on a dequantised copy wins


def _bind(lib: ctypes.CDLL) -> None:
    lib.ds_int8_linear_isa.restype = ctypes.c_char_p
    lib.ds_int8_linear.restype = ctypes.c_int
    lib.ds_int8_linear.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4


_OP = LazyOp("int8 linear", lambda: builder.cpu_op_spec("ds_int8_linear", str(SOURCE),
                                                        ("ds_int8_linear", "ds_int8_linear_isa")), _bind)


def kernel_enabled() -> bool:
    return os.environ.get("DSLAUNCH_INT8_KERNEL", "1") != "0"


def kernel_isa() -> Optional[str]:
    """The instruction set of the loaded kernel, or None when it is not usable here."""
    return _OP.lib.ds_int8_linear_isa().decode() if _OP.load() else None


def _kernel(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> Optional[torch.Tensor]:
    rows = x.numel() // x.shape[-1]
    if not (kernel_enabled() and x.device.type == "cpu" and x.dtype == torch.float32
            and scales.dtype == torch.float32 and rows <= MAX_ROWS and not x.requires_grad):
        return None
    if not _OP.load():
        _OP.warn_fallback("the torch dequantisation op")
        return None
    n, k = q.shape
    xc = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    rc = _OP.lib.ds_int8_linear(rows, n, k, group, xc.data_ptr(), q.data_ptr(), scales.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"int8 linear: {k} input columns are not a multiple of the group {group}")
    return out.reshape(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                dtype: torch.dtype) -> torch.Tensor:
    out = _kernel(x, q, scales, group)
    return out if out is not None else F.linear(x, dequantize_int8(q, scales, dtype))
