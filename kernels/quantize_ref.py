"""Block quantization as plain torch: the specification the compiled ops (quantizer.cpp,
quantizer.cu) are tested against bit for bit, and the path taken when no op can be built.

The arithmetic is DeepSpeed 0.19.8's symmetric quantizer (csrc/quantization, the kernels
behind ZeRO++'s qwZ and qgZ), written out:

  a tensor of n elements is cut into `groups` blocks of E = n / groups consecutive elements;
  per block:  amax  = max |x|                      (x read as float32)
              scale = 2^bits / (2 * amax)          (float32 division; 1.0 when amax == 0)
              q     = clamp(rint(x * scale), -2^(bits-1), 2^(bits-1) - 1)
                                                   (rint: nearest, ties to even)
              kept  = 1 / scale                    (float32 division: the per-block float32
                                                    "scale" that travels with the bytes)
  dequantized x = dtype(float(q) * kept)           (one rounding, to nearest even)

Bytes: int8 keeps one q per byte. int4 packs two per byte, the first element of a pair in
the high nibble and the second in the low one (DeepSpeed's PackedInt4 bit field as nvcc lays
it out); a nibble is a two's-complement 4-bit number.

Where this differs from DeepSpeed, on purpose:
- a block whose amax is not finite (an inf or NaN in it) keeps q = 0 and a NaN scale, so it
  dequantizes to NaN and the overflow check after the reduction still sees it; DeepSpeed's
  kernel turns NaN into 0 and inf into the clamp value, hiding an fp16 overflow;
- DeepSpeed's kernels read their input as fp16 whatever its dtype (a bf16 or fp32 gradient
  handed to its qgZ is misread); here x is read in its own dtype (fp16, bf16 or fp32).
  ZeRO-3's qwZ converts weights to fp16 first, as DeepSpeed's does, so its bytes are
  DeepSpeed's.
DeepSpeed builds its CUDA kernels with --use_fast_math, where a float32 division may be off
by up to 2 ulp; the divisions here are IEEE (correctly rounded), as are the compiled ops'.

`qwz_groups(n)` is DeepSpeed's block count for the quantized all-gather (CUDAQuantizer):
blocks of about 8000 elements (never 16000 or more) whose size is a multiple of 8.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

BITS = (4, 8)
QWZ_TARGET_GROUP = 8000  # DeepSpeed's CUDAQuantizer.target_group_size
QWZ_ALIGN = 8  # elements: DeepSpeed's kernel loads 8 fp16 values (16 bytes) at a time


def qwz_groups(n: int) -> int:
    """DeepSpeed's block count for `n` elements (a positive multiple of 8): the first count
    from ceil(n / 8000) up whose block size is a multiple of 8, doubled while the blocks stay
    above 8000 elements and the halves are multiples of 8."""
    if n <= 0 or n % QWZ_ALIGN:
        raise ValueError(f"qwz_groups: {n} elements; expected a positive multiple of {QWZ_ALIGN}")
    groups = math.ceil(n / QWZ_TARGET_GROUP)
    while groups < n and n % (QWZ_ALIGN * groups):
        groups += 1
    while n % (QWZ_ALIGN * groups * 2) == 0 and n / groups > QWZ_TARGET_GROUP:
        groups *= 2
    return groups


def check_layout(n: int, groups: int, bits: int) -> int:
    """The block size E of `n` elements in `groups` blocks, or ValueError naming the problem."""
    if bits not in BITS:
        raise ValueError(f"quantize: bits must be 4 or 8, got {bits}")
    if groups < 1 or n < 1 or n % groups:
        raise ValueError(f"quantize: {n} elements do not split into {groups} equal blocks")
    e = n // groups
    if bits == 4 and e % 2:
        raise ValueError(f"quantize: int4 blocks pack two elements a byte; {e} elements per block is odd")
    return e


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # tensor / tensor: one correctly rounded float32 division (a Python number on the left
    # would become reciprocal() * number, two roundings)
    return torch.div(a, b)


def quantize(x: torch.Tensor, groups: int, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q int8 (n bytes for 8 bits, n / 2 for 4), scales float32 (`groups`)."""
    n = x.numel()
    e = check_layout(n, groups, bits)
    xf = x.detach().reshape(groups, e).float()
    amax = xf.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    one = torch.ones_like(amax)
    scale = torch.where(amax == 0, one, _div(torch.full_like(amax, float(1 << bits)), amax * 2))
    tiny = finite & torch.isinf(scale)  # amax below ~3.8e-37 (fp32 input): a block of zeros
    usable = finite & ~tiny
    scale = torch.where(usable, scale, one)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.round(xf * scale[:, None]).clamp_(lo, hi)
    q = torch.where(usable[:, None], q, torch.zeros_like(q)).to(torch.int16).reshape(-1)
    kept = torch.where(usable, _div(one, scale),
                       torch.where(tiny, torch.zeros_like(one), torch.full_like(one, float("nan"))))
    if bits == 4:
        pairs = q.view(-1, 2)
        q = ((pairs[:, 0] & 0xF) << 4) | (pairs[:, 1] & 0xF)
    return q.to(torch.uint8).view(torch.int8), kept


def unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The q values as int16, one per element (int4: high nibble first)."""
    q16 = q.reshape(-1).to(torch.int16)
    if bits == 8:
        return q16
    first = q16 >> 4  # arithmetic shift of the sign-extended byte: the high nibble's value
    second = ((q16 & 0xF) ^ 8) - 8
    return torch.stack([first, second], dim=1).reshape(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The flat dequantized tensor (n elements) in `dtype`."""
    vals = unpack(q, bits)
    groups = scales.numel()
    check_layout(vals.numel(), groups, bits)
    out = vals.float().view(groups, -1) * scales.reshape(-1, 1).float()
    return out.reshape(-1).to(dtype)
