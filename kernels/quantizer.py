"""ZeRO++'s block quantizer as torch ops: `quantize` and `dequantize` of flat tensors in
equal blocks, int8 or int4 with one float32 scale per block.

    q, scales = quantize(x, groups, bits)          # q int8: n bytes (8 bits) or n/2 (4 bits)
    y = dequantize(q, scales, bits, torch.float16)  # n elements

The maths (DeepSpeed 0.19.8's symmetric quantizer, and where it differs on purpose) is
quantize_ref.py, the plain-torch specification the ops equal bit for bit. CPU tensors go
through the SIMD op (quantizer.cpp + quantizer_op.cpp), CUDA tensors through the CUDA op
(quantizer.cu + quantizer_cuda_op.cpp); both are built on first use like the optimizer
kernels (builder.py). Where an op cannot be built, the reference computes the same bytes,
slower, with one warning naming the cause.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import torch

from . import builder, quantize_ref, torch_ops
from .loader import LazyOp
from .tensor_args import default_threads

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(op: str, n: int, groups: int, bits: int) -> None:
    try:
        quantize_ref.check_layout(n, groups, bits)
    except ValueError as e:
        raise RuntimeError(str(e).replace("quantize:", f"{op}:", 1)) from None


def _fake_quantize(x, q, scales, bits, num_threads) -> None:
    """quantize_into on fake tensors (torch.compile): the op's checks, no computation."""
    _check("quantize_into", x.numel(), scales.numel(), bits)
    if q.dtype != torch.int8 or q.numel() != (x.numel() if bits == 8 else x.numel() // 2):
        raise RuntimeError(f"quantize_into: q must be int8 with {x.numel() * bits // 8} bytes")


def _fake_dequantize(q, scales, out, bits, num_threads) -> None:
    _check("dequantize_into", out.numel(), scales.numel(), bits)
    if q.dtype != torch.int8 or q.numel() != (out.numel() if bits == 8 else out.numel() // 2):
        raise RuntimeError(f"dequantize_into: q must be int8 with {out.numel() * bits // 8} bytes")


def _bind(prefix: str):
    def bind(lib: ctypes.CDLL):
        if prefix == "ds_quant":
            lib.ds_quant_isa.restype = ctypes.c_char_p
        return (torch_ops.register(lib, prefix, "quantize_into", _fake_quantize),
                torch_ops.register(lib, prefix, "dequantize_into", _fake_dequantize))
    return bind


def _no_cuda() -> Optional[str]:
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


class QuantizerOp(LazyOp):
    """The CPU op at an instruction-set level (default: the best this CPU runs)."""

    def __init__(self, isa: Optional[str] = None):
        super().__init__("ZeRO++ quantizer", lambda: builder.quantizer_spec(isa), _bind("ds_quant"))


_CPU_OP = QuantizerOp()
_CUDA_OP = LazyOp("ZeRO++ CUDA quantizer", builder.quantizer_cuda_spec, _bind("ds_quant_cuda"), _no_cuda)


def _op_for(device: torch.device) -> Optional[LazyOp]:
    if device.type == "cpu":
        return _CPU_OP
    if device.type == "cuda":
        return _CUDA_OP
    return None


def quantizer_available(device: str = "cpu") -> bool:
    """Whether the compiled op for `device` ("cpu" or "cuda") loads (building it on first call)."""
    op = _op_for(torch.device(device))
    return op is not None and op.load()


def quantize(x: torch.Tensor, groups: int, bits: int, op: Optional[LazyOp] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize the flat contents of `x` (fp32, bf16 or fp16) into `groups` blocks
    (`op`: a specific build, for tests; default: the op of x's device)."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"quantize: x has dtype {x.dtype}; expected float32, bfloat16 or float16")
    x = x.detach().reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    quantize_ref.check_layout(n, groups, bits)
    op = op or _op_for(x.device)
    if op is None or not op.load():
        if op is not None:
            op.warn_fallback("the plain-torch quantizer (same bytes, slower)")
        return quantize_ref.quantize(x, groups, bits)
    q = torch.empty(n if bits == 8 else n // 2, dtype=torch.int8, device=x.device)
    scales = torch.empty(groups, dtype=torch.float32, device=x.device)
    op.torch_op[0](x, q, scales, bits, default_threads())
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16,
               op: Optional[LazyOp] = None) -> torch.Tensor:
    """The flat tensor `quantize` packed into (q, scales), in `dtype` (fp32, bf16 or fp16)."""
    if dtype not in _DTYPES:
        raise TypeError(f"dequantize: dtype {dtype}; expected float32, bfloat16 or float16")
    if q.dtype != torch.int8 or scales.dtype != torch.float32:
        raise TypeError(f"dequantize: q must be int8 and scales float32 (got {q.dtype}, {scales.dtype})")
    q, scales = q.reshape(-1).contiguous(), scales.reshape(-1).contiguous()
    n = q.numel() * (8 // bits) if bits in quantize_ref.BITS else 0
    quantize_ref.check_layout(n, scales.numel(), bits)
    op = op or _op_for(q.device)
    if op is None or not op.load():
        if op is not None:
            op.warn_fallback("the plain-torch quantizer (same values, slower)")
        return quantize_ref.dequantize(q, scales, bits, dtype)
    out = torch.empty(n, dtype=dtype, device=q.device)
    op.torch_op[1](q, scales, out, bits, default_threads())
    return out
