"""DeepSpeed 0.19.8's CUDA quantizer module (`QuantizerBuilder().load()`: ops/csrc/quantization)
re-implemented on the CPU in plain torch, behind the same interface, so that DeepSpeed's own
ZeRO++ code (partition_parameters.py's CUDAQuantizer, coalesced_collectives.py's
all_to_all_quant_reduce) can run on its CPU accelerator. DeepSpeed has no CPU build of these
kernels; scripts/make_ds_zeropp_fixtures.py installs this module in their place and changes
nothing else of DeepSpeed.

Written from the CUDA sources, independently of dslaunch's kernels (kernels/quantize_ref.py
and quantizer.cpp), one kernel per function:

  quantize / dequantize    quantize.cu, dequantize.cu: symmetric blocks, scale = 2^bits /
                           (2 * absmax) (1 when absmax is 0), q = clamp(rint(x * scale)),
                           the stored parameter 1/scale; values back as fp16
  swizzle_quant            swizzled_quantize.cu: the same blocks, moved so that partition
                           p (of nodes * devices_per_node) lands at
                           pipeline_offset + (p % devices) * nodes + p // devices
  quantized_reduction      quant_reduce.cu: per output block, the devices_per_node input
                           tensors dequantized to fp16 and summed in fp16 (in device order,
                           from 0), then quantized again

Where the CPU cannot do what the GPU does: the kernels read their input as fp16 bits. Here a
tensor of another dtype is converted to fp16 by value first (DeepSpeed's qgZ hands its
kernel the gradient as it is, so with fp32 or bf16 gradients its CUDA result would be
meaningless; this run shows what its algorithm gives). The divisions are IEEE here; DeepSpeed
builds with --use_fast_math (up to 2 ulp on a scale). NaN blocks are not special-cased (the
GPU's __float2int_rn of NaN is 0; torch's is undefined): the fixture's inputs are finite.
The scales come back flat ([groups], where the CUDA module's are [groups, 1]): DeepSpeed
all-gathers them into a flat buffer, which NCCL accepts from a [groups, 1] tensor and gloo
refuses ("invalid tensor size"); the values and their order are the same.
"""
from __future__ import annotations

import torch

Symmetric, Asymmetric = 0, 1


def _blocks(x: torch.Tensor, groups: int, bits: int):
    """(q values as int32 [groups, E], stored scales float32 [groups]) of fp16 x."""
    h = x.reshape(groups, -1).to(torch.float16).to(torch.float32)
    absmax = h.abs().amax(dim=1)
    scale = torch.where(absmax == 0, torch.ones_like(absmax),
                        torch.div(torch.full_like(absmax, float(1 << bits)), 2 * absmax))
    hi = (1 << (bits - 1)) - 1
    q = torch.round(h * scale[:, None]).clamp(-hi - 1, hi).to(torch.int32)
    return q, torch.div(torch.ones_like(scale), scale)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 bytes of q (int4: PackedInt4 {high: second, low: first}, i.e. first << 4 | second)."""
    q = q.reshape(-1)
    if bits == 4:
        q = ((q[0::2] & 0xF) << 4) | (q[1::2] & 0xF)
    return (q & 0xFF).to(torch.uint8).view(torch.int8)


def _unpack(data: torch.Tensor, bits: int) -> torch.Tensor:
    b = data.reshape(-1).to(torch.int32)
    if bits == 8:
        return b
    low = b >> 4  # PackedInt4.low (bits 4-7, sign-extended): the first element
    high = ((b & 0xF) ^ 8) - 8  # PackedInt4.high (bits 0-3): the second
    return torch.stack([low, high], dim=1).reshape(-1)


def _dequant(data: torch.Tensor, scales: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    q = _unpack(data, bits).to(torch.float32).view(groups, -1)
    return (q * scales.reshape(-1, 1).to(torch.float32)).to(torch.float16).reshape(-1)


def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int):
    assert quant_type == Symmetric
    q, s = _blocks(input_vals, groups, num_bits)
    shape = list(input_vals.shape)
    shape[-1] //= 8 // num_bits
    return [_pack(q, num_bits).view(shape), s]


def dequantize(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: int):
    assert quant_type == Symmetric
    shape = list(quantized_data.shape)
    shape[-1] *= 8 // num_bits
    return _dequant(quantized_data, params, groups, num_bits).view(shape)


def swizzle_quant(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int, pipeline_size: int,
                  nodes: int, devices_per_node: int):
    assert quant_type == Symmetric
    q, s = _blocks(input_vals, groups, num_bits)
    partitions = nodes * devices_per_node
    per_partition = groups // partitions
    contiguous = per_partition // pipeline_size
    src, dst = [], []
    for z in range(partitions):  # the kernel's grid: (contiguous, pipeline_size, partitions)
        for y in range(pipeline_size):
            output_partition = y * partitions + (z % devices_per_node) * nodes + z // devices_per_node
            for x in range(contiguous):
                src.append(x + y * contiguous + z * contiguous * pipeline_size)
                dst.append(output_partition * contiguous + x)
    out_q = torch.empty_like(q)
    out_s = torch.empty_like(s)
    out_q[dst] = q[src]
    out_s[dst] = s[src]
    return [_pack(out_q, num_bits), out_s]


def quantized_reduction(input_vals: torch.Tensor, input_scales: torch.Tensor, in_groups: int, out_groups: int,
                        num_bits: int, quant_type: int, devices_per_node: int):
    assert quant_type == Symmetric
    per_tensor_groups = in_groups // devices_per_node
    data = input_vals.reshape(devices_per_node, -1)
    scales = input_scales.reshape(devices_per_node, per_tensor_groups)
    acc = torch.zeros(data.shape[1] * (8 // num_bits), dtype=torch.float16)
    for j in range(devices_per_node):  # the kernel's loop over the tensors, summing fp16
        acc = acc + _dequant(data[j], scales[j], per_tensor_groups, num_bits)
    q, s = _blocks(acc, out_groups, num_bits)
    shape = list(input_vals.shape)
    shape[-1] //= devices_per_node
    return [_pack(q, num_bits).view(shape), s]
