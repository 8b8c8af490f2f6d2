"""Group-wise asymmetric int4/int8 weight quantization after a model is built (DeepSpeed's
deepspeed.inference.quantization: its `weight_quantization.post_init_quant` section).

A weight is cut along `group_dim` into groups of `group_size` consecutive entries. Each
group keeps its minimum m and a scale s = (2^bits - 1) / (max - m); an entry x is stored as
the unsigned integer round(clamp((x - m) * s, 0, 2^bits - 1)) and read back as q / s + m, so
it is off by at most 1 / (2 s) = (max - m) / (2 (2^bits - 1)). int4 values are packed two to
a byte along the last dimension (the even entry in the high nibble). The arithmetic runs in
the weight's own dtype, as DeepSpeed's does, so the stored bytes are DeepSpeed's; a float16
clamp and round on the CPU go through float32 (the CPU has no float16 kernels for them).

quantize_model() replaces each nn.Linear / nn.Embedding whose qualified name contains a key
of the section by QuantizedLinear / QuantizedEmbedding: the packed integers and per-group
scales and minimums as buffers, the weight rebuilt for each forward. The ZeRO-3 variants
(quantizing while parameters are partitioned, or at zero.Init) are refused in one line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dslaunch.runtime.core.strict import ConfigError

SECTION = "weight_quantization.post_init_quant"


@dataclass(frozen=True)
class GroupSpec:
    num_bits: int
    group_size: int
    group_dim: int

    @classmethod
    def parse(cls, config: Mapping, where: str = SECTION) -> "GroupSpec":
        bits = config.get("num_bits")
        if bits not in (4, 8):
            raise ConfigError(f"{where}.num_bits: {bits!r}: only 4 and 8 bits are supported")
        if config.get("symmetric", False):
            raise ConfigError(f"{where}.symmetric: only asymmetric (min/max) quantization is supported; "
                              "set it false")
        size, dim = config.get("group_size"), config.get("group_dim", 0)
        if not isinstance(size, int) or size <= 0:
            raise ConfigError(f"{where}.group_size: {size!r}: expected a positive integer")
        return cls(bits, size, dim)

    @property
    def top(self) -> int:
        return 2 ** self.num_bits - 1

    def grouped(self, shape: torch.Size) -> Tuple[int, ...]:
        """`shape` with dimension group_dim split into (groups, group_size)."""
        d = self.group_dim
        if shape[d] % self.group_size:
            raise ValueError(f"group-wise quantization: dimension {d} of a {tuple(shape)} tensor is not a multiple "
                             f"of group_size {self.group_size}")
        return tuple(shape[:d]) + (shape[d] // self.group_size, self.group_size) + tuple(shape[d + 1:])


def _on_float32_if_cpu_half(t: torch.Tensor, op) -> torch.Tensor:
    if t.device.type == "cpu" and t.dtype == torch.float16:
        return op(t.float()).to(torch.float16)
    return op(t)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last dimension, got {tuple(q.shape)}")
    return (q[..., 0::2] << 4) | q[..., 1::2]


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.uint8, device=packed.device)
    out[..., 0::2] = packed >> 4
    out[..., 1::2] = packed & 0xF
    return out


class Quantizer:
    """quantize(x) -> (packed uint8 values, per-group scales, per-group minimums)."""

    def __init__(self, config: Mapping) -> None:
        self.config = dict(config)
        self.spec = GroupSpec.parse(config)

    def quantize(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec = self.spec
        x = tensor.detach().reshape(spec.grouped(tensor.shape)).clone()
        axis = spec.group_dim + 1  # the within-group axis
        low = x.amin(dim=axis, keepdim=True)
        scale = spec.top / (x.amax(dim=axis, keepdim=True) - low)
        x.sub_(low).mul_(scale)
        x = _on_float32_if_cpu_half(x, lambda t: t.clamp(0, spec.top).round())
        q = x.to(torch.uint8).reshape(tensor.shape)
        return (_pack4(q) if spec.num_bits == 4 else q), scale, low


class DeQuantizer:
    """dequantize(packed, scale, minimum) -> the weight in `dtype`."""

    def __init__(self, config: Mapping, dtype: torch.dtype) -> None:
        self.config = dict(config)
        self.spec = GroupSpec.parse(config)
        self.dtype = dtype

    def dequantize(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        q = _unpack4(packed) if self.spec.num_bits == 4 else packed
        shape = q.shape
        values = q.reshape(self.spec.grouped(shape)).to(self.dtype)
        return (values / scale + minimum).reshape(shape)


class _Quantized(nn.Module):
    """The packed weight, its scales and minimums as buffers; `weight` is rebuilt on read."""

    def _store(self, config: Mapping, weight: torch.Tensor) -> None:
        self.config = dict(config)
        self.dequantizer = DeQuantizer(config, weight.dtype)
        packed, scale, low = Quantizer(config).quantize(weight)
        self.register_buffer("qweight", packed)
        self.register_buffer("qscale", scale)
        self.register_buffer("qmin", low)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantizer.dequantize(self.qweight, self.qscale, self.qmin)


class QuantizedLinear(_Quantized):
    def __init__(self, config: Mapping, pre_quant_layer: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = pre_quant_layer.in_features, pre_quant_layer.out_features
        self._store(config, pre_quant_layer.weight.data)
        self.bias = pre_quant_layer.bias

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


class QuantizedEmbedding(_Quantized):
    def __init__(self, config: Mapping, pre_quant_layer: nn.Embedding) -> None:
        super().__init__()
        layer = pre_quant_layer
        if layer.max_norm is not None or layer.scale_grad_by_freq or layer.sparse:
            raise ConfigError(f"{SECTION}: an embedding with max_norm, scale_grad_by_freq or sparse gradients "
                              "cannot be quantized (its weight would have to change or be differentiated)")
        self.num_embeddings, self.embedding_dim, self.padding_idx = (layer.num_embeddings, layer.embedding_dim,
                                                                     layer.padding_idx)
        self._store(config, layer.weight.data)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.embedding(input, self.weight, self.padding_idx)


LAYERS = {nn.Linear: QuantizedLinear, nn.Embedding: QuantizedEmbedding}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_model(model: nn.Module, ds_config: Mapping) -> nn.Module:
    """Replace the Linear/Embedding layers the config's post_init_quant keys name (a key
    matches every layer whose qualified name contains it; two keys matching one layer is an
    error) by their quantized versions; the model is changed in place and returned."""
    section = (ds_config or {}).get("weight_quantization")
    if not isinstance(section, Mapping) or not isinstance(section.get("post_init_quant"), Mapping):
        raise ConfigError(f"{SECTION}: missing; give {{key: {{num_bits, group_size, group_dim, symmetric}}}}")
    zero = ds_config.get("zero_optimization") or {}
    if zero.get("stage") == 3:
        raise ConfigError(f"{SECTION}: quantizing ZeRO-3 partitioned parameters (DeepSpeed's QuantizationContext) "
                          "is not provided; quantize the assembled model outside ZeRO-3")
    keys: Dict[str, Mapping] = dict(section["post_init_quant"])
    for key, cfg in keys.items():
        GroupSpec.parse(cfg, f"{SECTION}.{key}")
    for name, module in list(model.named_modules()):
        kind = LAYERS.get(type(module))
        if kind is None:
            continue
        hits = [key for key in keys if key in name]
        if len(hits) > 1:
            raise ConfigError(f"{SECTION}: module {name} matches more than one key ({', '.join(hits)})")
        if hits:
            _replace(model, name, kind(keys[hits[0]], module))
    return model


# DeepSpeed's name for the call (deepspeed.inference.quantization.quantization)
_init_group_wise_weight_quantization = quantize_model
