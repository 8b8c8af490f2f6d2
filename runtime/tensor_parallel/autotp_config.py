"""DeepSpeed's AutoTP layer-spec objects (`deepspeed.module_inject.autotp_config`) and its
Hugging Face tp-plan converter (`deepspeed.module_inject.tp_plan_converter`).

These are the objects scripts build or inspect: PartitionType, TPLayerSpec (regex patterns, a
partition type, an optional logical shape with equal or unequal sub-parameters, gather_output,
grad_allreduce), AutoTPConfig (from_dict, find_matching_spec), merge_autotp_configs, and
TPPlanConverter.convert (a Hugging Face `_tp_plan` as layer specs). Their checks and answers
are DeepSpeed 0.19.8's.

The training sharding reads `tensor_parallel.partition_config` through the strict parser
(core/config/partition.py), which refuses what dslaunch's layers cannot split; these objects
only describe. DeepSpeed's per-model AutoTPPresets are not provided: dslaunch shards from
partition_config, the model's Hugging Face plan or its structure.
"""
from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from .autotp import HF_STYLES

logger = logging.getLogger(__name__)


class PartitionType(enum.Enum):
    COLUMN = "column"  # output features split; the backward all-reduces the input's gradient
    ROW = "row"  # input features split; the forward all-reduces the output
    SKIP = "skip"  # left whole


Shape = Tuple[Union[int, Tuple[int, ...]], ...]


def _tuples(shape: Any) -> Any:
    """Lists (from JSON) as tuples, at any depth (a tuple's own tuples are kept as given)."""
    if isinstance(shape, list):
        return tuple(_tuples(x) for x in shape)
    if isinstance(shape, tuple):
        return tuple(_tuples(x) if isinstance(x, list) else x for x in shape)
    return shape


@dataclass
class TPLayerSpec:
    """One rule: parameters whose names match a pattern (re.match) are split this way.

    `shape` is the weight's logical shape when it fuses sub-parameters: -1 for a dimension to
    infer, an int count of equal sub-parameters, or a tuple of their sizes at the partition
    dimension (one level of nesting). `partition_dim` defaults to 0 for COLUMN, 1 otherwise."""

    patterns: List[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Optional[Shape] = None
    partition_dim: Optional[int] = None
    model_types: Optional[List[str]] = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self):
        if isinstance(self.partition_type, str):
            self.partition_type = PartitionType(self.partition_type.lower())
        if self.shape is not None:
            self.shape = _tuples(self.shape)
            self._check_shape()

    def _check_shape(self) -> None:
        if not isinstance(self.shape, tuple):
            raise ValueError("AutoTP shape must be a tuple of ints or a tuple at partition_dim.")
        dim = self.get_partition_dim()
        if not 0 <= dim < len(self.shape):
            raise ValueError(f"AutoTP partition_dim {dim} is out of range for shape length {len(self.shape)}.")
        nested = False
        for i, d in enumerate(self.shape):
            if isinstance(d, tuple):
                if i != dim:
                    raise ValueError(f"AutoTP shape nested tuple only allowed at partition_dim={dim}, got at {i}.")
                if nested:
                    raise ValueError("AutoTP shape supports only 1-level nesting at partition_dim.")
                nested = True
                if not d:
                    raise ValueError("AutoTP shape nested tuple cannot be empty.")
                for size in d:
                    if isinstance(size, tuple):
                        raise ValueError("AutoTP shape supports only 1-level nesting at partition_dim.")
                    if not isinstance(size, int) or size <= 0:
                        raise ValueError("AutoTP nested sub-parameter sizes must be positive integers.")
            elif isinstance(d, int):
                if d == 0 or d < -1:
                    raise ValueError("AutoTP shape dimensions must be positive integers or -1.")
            else:
                raise ValueError("AutoTP shape must contain only integers or a tuple at partition_dim.")

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def _at_dim(self):
        if self.shape is None:
            return None
        dim = self.get_partition_dim()
        return self.shape[dim] if dim < len(self.shape) else None

    def has_unequal_sub_params(self) -> bool:
        return isinstance(self._at_dim(), tuple)

    def get_sub_param_sizes(self) -> Optional[Tuple[int, ...]]:
        at = self._at_dim()
        return at if isinstance(at, tuple) else None

    def get_num_sub_params(self) -> Optional[int]:
        at = self._at_dim()
        if isinstance(at, tuple):
            return len(at)
        return at if isinstance(at, int) and at > 0 else None

    def matches(self, param_name: str, model_type: Optional[str] = None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in [str(t).lower() for t in self.model_types]:
                return False
        return any(re.match(p, param_name) for p in self.patterns)


_warned: set = set()


@dataclass
class AutoTPConfig:
    """tensor_parallel.partition_config as an object: the layer specs, first match wins."""

    tp_size: int = 1
    layer_specs: List[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: List[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False

    def find_matching_spec(self, param_name: str, model_type: Optional[str] = None) -> Optional[TPLayerSpec]:
        found = [s for s in self.layer_specs if s.matches(param_name, model_type)]
        if len(found) > 1:
            message = (f"AutoTPConfig: parameter {param_name} matched multiple layer_specs "
                       f"{[s.patterns for s in found]}; using the first match.")
            if message not in _warned:  # once per message, as DeepSpeed's warning_once
                _warned.add(message)
                logger.warning(message)
        return found[0] if found else None

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any]) -> "AutoTPConfig":
        specs = [TPLayerSpec(patterns=s.get("patterns", []), partition_type=s.get("partition_type", "column"),
                             gather_output=s.get("gather_output", False), grad_allreduce=s.get("grad_allreduce", False),
                             shape=s.get("shape"), partition_dim=s.get("partition_dim"),
                             model_types=s.get("model_types"))
                 for s in config_dict.get("layer_specs", [])]
        return cls(tp_size=config_dict.get("tp_size", 1), layer_specs=specs,
                   embedding_partition_dim=config_dict.get("embedding_partition_dim", 1),
                   lm_head_patterns=config_dict.get("lm_head_patterns", ["lm_head", "embed_out"]),
                   use_default_specs=config_dict.get("use_default_specs", True),
                   strict_mode=config_dict.get("strict_mode", False))


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """`override`'s specs first (they win), then `base`'s; override's flags; its tp_size when above 1."""
    return AutoTPConfig(tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
                        layer_specs=list(override.layer_specs) + list(base.layer_specs),
                        embedding_partition_dim=override.embedding_partition_dim,
                        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
                        use_default_specs=override.use_default_specs, strict_mode=override.strict_mode)


SUPPORTED_STYLES = set(HF_STYLES)


class TPPlanConverter:
    """A Hugging Face tp plan ({"layers.*.self_attn.q_proj": "colwise", ...}) as TPLayerSpecs."""

    @staticmethod
    def convert(hf_tp_plan: Dict[str, str]) -> Optional[List[TPLayerSpec]]:
        """One spec per entry; None for an empty plan. One unknown style rejects the whole plan
        (a ValueError): applying the rest could split one half of a column/row pair."""
        if not hf_tp_plan:
            return None
        unknown = {style for style in hf_tp_plan.values() if style.lower() not in SUPPORTED_STYLES}
        if unknown:
            raise ValueError(f"HuggingFace tp_plan contains unsupported partition style(s): {sorted(unknown)}. "
                             "Applying only the supported entries could shard one half of a column/row pair, so "
                             "the plan is rejected as a whole. Provide an explicit "
                             "'tensor_parallel.partition_config' for this model instead.")
        specs = []
        for pattern, style in hf_tp_plan.items():
            s = style.lower()
            regex = TPPlanConverter._wildcard_to_regex(pattern)
            regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
            if s.startswith("colwise"):
                ptype = PartitionType.COLUMN
            elif s == "rowwise":
                ptype = PartitionType.ROW
            else:  # embedding_rowwise (left to the vocabulary split) and replicated_with_grad_allreduce
                ptype = PartitionType.SKIP
            specs.append(TPLayerSpec(patterns=[regex], partition_type=ptype, gather_output=s in (
                "colwise_rep", "colwise_gather_output"), grad_allreduce=s == "replicated_with_grad_allreduce"))
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        return ".*" + pattern.replace(".", r"\.").replace("*", ".*")
