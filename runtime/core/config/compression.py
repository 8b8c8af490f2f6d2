"""`compression_training`: pruning and quantization-aware training (runtime/train/compression/).

The section keeps DeepSpeed's layout: one block per technique, each with `shared_parameters`
(on/off, schedule, method) and `different_groups` (named groups of module-name patterns with
their own `params`). Every key whose only reader in DeepSpeed was a path not built here
(snip_momentum's block_pattern, the in-place MoQ quantizer's knobs) is refused with one line,
so nothing is accepted and then ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional

from ..strict import ConfigError, disabled, refused, supported
from .checks import positive

SNIP = "the snip_momentum method (neural_compressor) is not supported; use method l1 or topk"
MOQ = ("only the fake-quant-in-forward path is supported (quantize_weight_in_forward true); DeepSpeed's "
       "in-place MoQ quantizer is not")


def _once(what: str, unit: str):
    """schedule_offset_end / schedule_offset_stride of a technique that prunes once: DeepSpeed
    0.17.6's parser never reads them there (its scheduler reads them for sparse pruning only),
    so a 0.17 config may carry them with no effect. Refused rather than ignored, saying so."""
    return refused(f"DeepSpeed 0.17.6 ignores this key for {what} (it masks the {unit} once, at schedule_offset), so "
                   "removing it changes nothing; remove it")


def _ratio(path: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ConfigError(f"{path}.dense_ratio: must be in (0, 1], got {value}")


def _offset(path: str, value: int) -> None:
    positive(path, "schedule_offset", value, allow_zero=True)


@dataclass
class PruneParams:
    dense_ratio: float = supported(note="fraction of the weights (rows, heads) kept")

    def validate(self, path: str) -> None:
        _ratio(path, self.dense_ratio)


@dataclass
class QuantParams:
    start_bits: int = supported(note="bits at schedule_offset")
    target_bits: int = supported(note="bits reached one bit per quantization_period steps later")
    quantization_period: int = supported(1, "steps between two one-bit reductions")

    def validate(self, path: str) -> None:
        for key in ("start_bits", "target_bits"):
            bits = getattr(self, key)
            if not 2 <= bits <= 16:
                raise ConfigError(f"{path}.{key}: must be between 2 and 16 bits, got {bits}")
        if self.target_bits > self.start_bits:
            raise ConfigError(f"{path}.target_bits: must be <= start_bits ({self.start_bits}), got {self.target_bits}")
        positive(path, "quantization_period", self.quantization_period)


@dataclass
class ActParams:
    bits: int = supported(note="bits of the layer's inputs (4 or 8, as DeepSpeed)")

    def validate(self, path: str) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"{path}.bits: must be 4 or 8 (as DeepSpeed), got {self.bits}")


MODULES = "regular expressions searched in module names (\"*\": every module the technique applies to)"


def _check_groups(path: str, groups: Dict[str, Any], enabled: bool, related: bool) -> None:
    if enabled and not groups:
        raise ConfigError(f"{path}.different_groups: required (at least one group) when enabled")
    for name, group in groups.items():
        where = f"{path}.different_groups.{name}"
        if not group.modules:
            raise ConfigError(f"{where}.modules: must list at least one pattern")
        if group.related_modules is None:
            continue
        if not related:
            raise ConfigError(f"{where}.related_modules: only row_pruning and head_pruning read it; remove it")
        if len(group.related_modules) != len(group.modules):
            raise ConfigError(f"{where}.related_modules: needs one list per entry of modules "
                              f"({len(group.modules)}), got {len(group.related_modules)}")


@dataclass
class PruneGroup:
    params: PruneParams = supported(note="dense_ratio")
    modules: List[str] = supported(factory=lambda: ["*"], note=MODULES)
    related_modules: Optional[List[List[str]]] = supported(
        None, "per modules entry, the patterns of the modules cut with it by redundancy_clean")


@dataclass
class QuantGroup:
    params: QuantParams = supported(note="start_bits, target_bits, quantization_period")
    modules: List[str] = supported(factory=lambda: ["*"], note=MODULES)
    related_modules: Optional[List[List[str]]] = supported(
        None, "weight quantization has no related modules: a value is refused")


@dataclass
class ActGroup:
    params: ActParams = supported(note="bits")
    modules: List[str] = supported(factory=lambda: ["*"], note=MODULES)
    related_modules: Optional[List[List[str]]] = supported(
        None, "activation quantization has no related modules: a value is refused")


@dataclass
class SparseShared:
    enabled: bool = supported(False, "unstructured weight pruning of Linear and Conv2d weights")
    method: Literal["l1", "topk", "snip_momentum"] = supported(
        "l1", "l1: smallest magnitudes (of the weights at init_compression, as DeepSpeed; a gradual schedule's "
               "steps: at each step); topk: learnt scores, straight-through")
    schedule_offset: int = supported(1000, "step at which pruning starts")
    schedule_offset_end: Optional[int] = supported(
        None, "step at which dense_ratio is reached (default schedule_offset: one shot); l1 prunes in equal steps")
    schedule_offset_stride: int = supported(1, "steps between two pruning steps from schedule_offset to _end")
    excluded_modules: List[str] = supported(factory=list, note="module-name patterns never pruned")
    block_pattern: Any = refused("block_pattern is read by snip_momentum only, which is not supported; remove it",
                                 None)
    dense_ratio: Any = refused("a shared dense_ratio is read by snip_momentum only; set it in each group's params",
                               None)

    def validate(self, path: str) -> None:
        if self.method == "snip_momentum":
            raise ConfigError(f"{path}.method: {SNIP}")
        _offset(path, self.schedule_offset)
        if self.schedule_offset_end is None:
            self.schedule_offset_end = self.schedule_offset
        if self.schedule_offset_end < self.schedule_offset:
            raise ConfigError(f"{path}.schedule_offset_end: must be >= schedule_offset ({self.schedule_offset}), "
                              f"got {self.schedule_offset_end}")
        positive(path, "schedule_offset_stride", self.schedule_offset_stride)


@dataclass
class RowShared:
    enabled: bool = supported(False, "output rows of Linear layers (and the related layers' input columns)")
    method: Literal["l1", "topk"] = supported("l1", "l1: smallest row L1 norms (of the weights at init_compression, "
                                                    "as DeepSpeed); topk: learnt")
    schedule_offset: int = supported(1000, "step at which the rows are masked")
    schedule_offset_end: Any = _once("row pruning", "rows")
    schedule_offset_stride: Any = _once("row pruning", "rows")

    def validate(self, path: str) -> None:
        _offset(path, self.schedule_offset)


@dataclass
class HeadShared:
    enabled: bool = supported(False, "attention heads: input column blocks of the output projection, learnt scores")
    method: Literal["topk", "l1"] = supported("topk", "topk only (learnt head scores, straight-through)")
    schedule_offset: int = supported(1000, "step at which the heads are masked")
    schedule_offset_end: Any = _once("head pruning", "heads")
    schedule_offset_stride: Any = _once("head pruning", "heads")
    num_heads: Optional[int] = supported(None, "heads of the attention (required)")

    def validate(self, path: str) -> None:
        if self.method != "topk":
            raise ConfigError(f"{path}.method: head pruning supports topk only (as DeepSpeed), got {self.method!r}")
        _offset(path, self.schedule_offset)
        positive(path, "num_heads", self.num_heads)


@dataclass
class ChannelShared:
    enabled: bool = supported(False, "output channels of Conv2d layers (and the related convs' input channels "
                                     "and batch norms)")
    method: Literal["l1", "topk"] = supported("l1", "l1: smallest channel L1 norms (of the weights at "
                                                    "init_compression); topk: learnt")
    schedule_offset: int = supported(1000, "step at which the channels are masked")
    schedule_offset_end: Any = _once("channel pruning", "channels")
    schedule_offset_stride: Any = _once("channel pruning", "channels")

    def validate(self, path: str) -> None:
        _offset(path, self.schedule_offset)


@dataclass
class QuantShared:
    enabled: bool = supported(False, "fake-quantized weights in forward (straight-through gradient)")
    quantize_weight_in_forward: bool = supported(False, "must be true (the fake-quant path)")
    schedule_offset: int = supported(0, "step at which quantization starts")
    quantize_groups: int = supported(1, "groups (of whole rows) with their own scale; embeddings: one per token")
    quantization_type: Literal["symmetric", "asymmetric"] = supported("symmetric", "zero point 0, or min/max range")
    rounding: Literal["nearest", "stochastic"] = supported("nearest", "nearest only")
    quantize_verbose: Any = refused(MOQ, False)
    quantizer_kernel: Any = refused(MOQ, False)
    fp16_mixed_quantize: Any = refused(MOQ, disabled)

    def validate(self, path: str) -> None:
        if self.enabled and not self.quantize_weight_in_forward:
            raise ConfigError(f"{path}.quantize_weight_in_forward: {MOQ}")
        if self.rounding != "nearest":
            raise ConfigError(f"{path}.rounding: only nearest rounding is supported, got {self.rounding!r}")
        _offset(path, self.schedule_offset)
        positive(path, "quantize_groups", self.quantize_groups)


@dataclass
class ActShared:
    enabled: bool = supported(False, "fake-quantized inputs of Linear and Conv2d layers (straight-through gradient)")
    quantization_type: Literal["symmetric", "asymmetric"] = supported("symmetric", "zero point 0, or min/max range")
    range_calibration: Literal["dynamic", "static"] = supported(
        "dynamic", "dynamic: each token's (Linear) or sample's (Conv2d) own range; static: a moving average of "
                   "the training batches' range, used as is in eval mode")
    schedule_offset: int = supported(1000, "step at which quantization starts")

    def validate(self, path: str) -> None:
        _offset(path, self.schedule_offset)


@dataclass
class ActivationQuantizationConfig:
    shared_parameters: ActShared = supported(factory=ActShared, note="")
    different_groups: Dict[str, ActGroup] = supported(factory=dict, note="named groups: params, modules")

    def validate(self, path: str) -> None:
        _check_groups(path, self.different_groups, self.shared_parameters.enabled, related=False)


@dataclass
class SparsePruningConfig:
    shared_parameters: SparseShared = supported(factory=SparseShared, note="")
    different_groups: Dict[str, PruneGroup] = supported(factory=dict, note="named groups: params, modules")

    def validate(self, path: str) -> None:
        _check_groups(path, self.different_groups, self.shared_parameters.enabled, related=False)


@dataclass
class RowPruningConfig:
    shared_parameters: RowShared = supported(factory=RowShared, note="")
    different_groups: Dict[str, PruneGroup] = supported(factory=dict, note="named groups: params, modules, "
                                                                              "related_modules")

    def validate(self, path: str) -> None:
        _check_groups(path, self.different_groups, self.shared_parameters.enabled, related=True)


@dataclass
class HeadPruningConfig:
    shared_parameters: HeadShared = supported(factory=HeadShared, note="")
    different_groups: Dict[str, PruneGroup] = supported(factory=dict, note="named groups: params, modules (the "
                                                                              "output projections), related_modules")

    def validate(self, path: str) -> None:
        if self.shared_parameters.enabled and self.shared_parameters.num_heads is None:
            raise ConfigError(f"{path}.shared_parameters.num_heads: required when head_pruning is enabled")
        _check_groups(path, self.different_groups, self.shared_parameters.enabled, related=True)


@dataclass
class ChannelPruningConfig:
    shared_parameters: ChannelShared = supported(factory=ChannelShared, note="")
    different_groups: Dict[str, PruneGroup] = supported(factory=dict, note="named groups: params, modules, "
                                                                              "related_modules")

    def validate(self, path: str) -> None:
        _check_groups(path, self.different_groups, self.shared_parameters.enabled, related=True)


@dataclass
class LayerReductionConfig:
    enabled: bool = supported(False, "init_compression keeps keep_number_layer layers of a stack, copied from "
                                     "teacher_layer of the teacher (or of the model itself), and drops the rest")
    keep_number_layer: Optional[int] = supported(None, "layers kept (required; = len(teacher_layer))")
    module_name_prefix: Optional[str] = supported(None, "the stack: a ModuleList/Sequential, e.g. "
                                                        "\"bert.encoder.layer\" (required)")
    teacher_layer: List[int] = supported(factory=list, note="the teacher's layer indices copied, in order")
    other_module_name: List[str] = supported(factory=list, note="modules copied from the teacher as they are "
                                                                "(embeddings, head)")

    def validate(self, path: str) -> None:
        if not self.enabled:
            return
        for key in ("keep_number_layer", "module_name_prefix"):
            if getattr(self, key) is None:
                raise ConfigError(f"{path}.{key}: required when layer_reduction is enabled")
        positive(path, "keep_number_layer", self.keep_number_layer)
        if len(self.teacher_layer) != self.keep_number_layer:
            raise ConfigError(f"{path}.teacher_layer: needs keep_number_layer ({self.keep_number_layer}) layer "
                              f"indices, got {self.teacher_layer}")
        if any(i < 0 for i in self.teacher_layer):
            raise ConfigError(f"{path}.teacher_layer: indices must be >= 0, got {self.teacher_layer}")


@dataclass
class WeightQuantizationConfig:
    shared_parameters: QuantShared = supported(factory=QuantShared, note="")
    different_groups: Dict[str, QuantGroup] = supported(factory=dict, note="named groups: params, modules")

    def validate(self, path: str) -> None:
        _check_groups(path, self.different_groups, self.shared_parameters.enabled, related=False)


@dataclass
class CompressionConfig:
    sparse_pruning: SparsePruningConfig = supported(factory=SparsePruningConfig, note="")
    row_pruning: RowPruningConfig = supported(factory=RowPruningConfig, note="")
    head_pruning: HeadPruningConfig = supported(factory=HeadPruningConfig, note="")
    weight_quantization: WeightQuantizationConfig = supported(factory=WeightQuantizationConfig, note="")
    channel_pruning: ChannelPruningConfig = supported(factory=ChannelPruningConfig, note="")
    activation_quantization: ActivationQuantizationConfig = supported(factory=ActivationQuantizationConfig, note="")
    layer_reduction: LayerReductionConfig = supported(factory=LayerReductionConfig, note="")

    @property
    def techniques(self) -> Dict[str, Any]:
        """The enabled techniques by DeepSpeed's name."""
        out = {}
        for name in ("weight_quantization", "sparse_pruning", "row_pruning", "head_pruning", "channel_pruning",
                     "activation_quantization"):
            section = getattr(self, name)
            if section.shared_parameters.enabled:
                out[name] = section
        return out

    @property
    def enabled(self) -> bool:
        return bool(self.techniques) or self.layer_reduction.enabled

