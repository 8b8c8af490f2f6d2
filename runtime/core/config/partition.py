"""`tensor_parallel.partition_config`: DeepSpeed's AutoTP layer specs, parsed strictly.

The schema of the key lives here, with the rest of the config, so that a config is checked
whole at load time without the tensor-parallel code (core/ imports no strategy). The AutoTP
sharding itself (runtime/tensor_parallel/autotp.py) applies the parsed PartitionConfig:
`layer_specs` of regex `patterns` matched (re.match, as DeepSpeed) against parameter names,
with `partition_type` column / row / skip, `gather_output`, `grad_allreduce`, `shape` +
`partition_dim` for fused outputs, `model_types`; `lm_head_patterns`; `strict_mode`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from ..strict import ConfigError, suggest


class TensorParallelError(ConfigError):
    """Something tensor parallelism cannot split, phrased as one line (exit 2 from a script).
    The error of runtime/tensor_parallel (shard.py exports it); defined with the schema of its
    config key, which raises it too."""


PARTITION_TYPES = ("column", "row", "skip")
SPEC_KEYS = ("patterns", "partition_type", "gather_output", "grad_allreduce", "shape", "partition_dim",
             "model_types")
CONFIG_KEYS = ("layer_specs", "use_default_specs", "strict_mode", "lm_head_patterns", "tp_size",
               "embedding_partition_dim")


def _fail(msg: str) -> TensorParallelError:
    return TensorParallelError(f"tensor parallel: {msg}")


@dataclass(frozen=True)
class LayerSpec:
    """One entry of partition_config.layer_specs (DeepSpeed's TPLayerSpec)."""

    patterns: Tuple[str, ...]
    partition_type: str = "column"
    gather_output: bool = False
    grad_allreduce: bool = False
    parts: Optional[Tuple[int, ...]] = None  # from `shape`: equal parts are (-k,) until the width is known
    model_types: Optional[Tuple[str, ...]] = None
    where: str = ""  # "partition_config.layer_specs[1]", for errors

    def matches(self, param_name: str, model_type: Optional[str]) -> bool:
        if self.model_types and (model_type is None or model_type.lower() not in self.model_types):
            return False
        return any(re.match(p, param_name) for p in self.patterns)

    def part_widths(self, out_features: int, name: str) -> Optional[Tuple[int, ...]]:
        if self.parts is None:
            return None
        if len(self.parts) == 1 and self.parts[0] < 0:  # k equal parts
            k = -self.parts[0]
            if out_features % k:
                raise _fail(f"{self.where}: shape splits {name} into {k} parts but its {out_features} output "
                            "features do not divide")
            return (out_features // k,) * k
        if sum(self.parts) != out_features:
            raise _fail(f"{self.where}: shape's parts {list(self.parts)} do not add up to the {out_features} "
                        f"output features of {name}")
        return self.parts


@dataclass
class PartitionConfig:
    layer_specs: List[LayerSpec] = field(default_factory=list)
    strict_mode: bool = False
    lm_head_patterns: Tuple[str, ...] = ("lm_head", "embed_out")
    source: str = "partition_config"
    tp_size: Optional[int] = None  # DeepSpeed overwrites it with autotp_size; here it must agree


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(f"{where} must be true or false, got {value!r}")
    return value


def _parse_shape(shape: Any, partition_dim: Any, ptype: str, where: str) -> Optional[Tuple[int, ...]]:
    if partition_dim is not None and partition_dim != (0 if ptype == "column" else 1):
        raise _fail(f"{where}.partition_dim: {partition_dim} is not supported for a {ptype} layer (dslaunch "
                    f"splits {ptype} layers along dimension {0 if ptype == 'column' else 1})")
    if shape is None:
        return None
    if ptype != "column" or not isinstance(shape, (list, tuple)) or len(shape) != 2 or shape[1] != -1:
        raise _fail(f"{where}.shape: {shape!r} is not supported; dslaunch takes a fused column output as "
                    "[k, -1] (k equal parts) or [[q, k, v], -1] (unequal parts)")
    first = shape[0]
    if isinstance(first, int) and not isinstance(first, bool) and first > 0:
        return (-first,)
    if isinstance(first, (list, tuple)) and first and all(isinstance(v, int) and v > 0 for v in first):
        return tuple(first)
    raise _fail(f"{where}.shape: {shape!r}: the first entry must be a part count or a list of part widths")


def parse_partition_config(config: Any) -> PartitionConfig:
    """DeepSpeed's `tensor_parallel.partition_config` dict -> PartitionConfig, strictly."""
    if isinstance(config, PartitionConfig):
        return config
    if not isinstance(config, dict):
        raise _fail(f"partition_config must be a dict, got {type(config).__name__}")
    for key in config:
        if key not in CONFIG_KEYS:
            raise _fail(f"partition_config: unknown key {key!r}{suggest(str(key), list(CONFIG_KEYS))}")
    if config.get("embedding_partition_dim", 1) != 1:
        raise _fail("partition_config.embedding_partition_dim: only 1 (DeepSpeed's default) is accepted; dslaunch "
                    "splits an embedding a spec names by vocabulary")
    _bool(config.get("use_default_specs", True), "partition_config.use_default_specs")  # no preset here: no effect
    specs = []
    raw = config.get("layer_specs", [])
    if not isinstance(raw, list) or not raw:
        raise _fail("partition_config.layer_specs must be a non-empty list of specs")
    for i, spec in enumerate(raw):
        where = f"partition_config.layer_specs[{i}]"
        if not isinstance(spec, dict):
            raise _fail(f"{where} must be a dict, got {type(spec).__name__}")
        for key in spec:
            if key not in SPEC_KEYS:
                raise _fail(f"{where}: unknown key {key!r}{suggest(str(key), list(SPEC_KEYS))}")
        patterns = spec.get("patterns")
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) for p in patterns):
            raise _fail(f"{where}.patterns must be a non-empty list of regular expressions")
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise _fail(f"{where}.patterns: {p!r} is not a regular expression ({exc})") from None
        ptype = str(spec.get("partition_type", "column")).lower()
        if ptype not in PARTITION_TYPES:
            raise _fail(f"{where}.partition_type: {spec.get('partition_type')!r} is not one of "
                        f"{', '.join(PARTITION_TYPES)}")
        gather = _bool(spec.get("gather_output", False), f"{where}.gather_output")
        grad = _bool(spec.get("grad_allreduce", False), f"{where}.grad_allreduce")
        if gather and ptype != "column":
            raise _fail(f"{where}.gather_output applies to column layers only")
        if grad and ptype != "skip":
            raise _fail(f"{where}.grad_allreduce applies to skip (replicated) layers only")
        parts = _parse_shape(spec.get("shape"), spec.get("partition_dim"), ptype, where)
        if parts is not None and gather:
            raise _fail(f"{where}: gather_output cannot be combined with a fused shape")
        types = spec.get("model_types")
        if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
            raise _fail(f"{where}.model_types must be a list of model type names")
        specs.append(LayerSpec(tuple(patterns), ptype, gather, grad, parts,
                               tuple(t.lower() for t in types) if types else None, where))
    heads = config.get("lm_head_patterns", ["lm_head", "embed_out"])
    if not isinstance(heads, list) or not all(isinstance(h, str) for h in heads):
        raise _fail("partition_config.lm_head_patterns must be a list of module names")
    tp = config.get("tp_size")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        raise _fail(f"partition_config.tp_size must be a positive integer, got {tp!r}")
    return PartitionConfig(specs, _bool(config.get("strict_mode", False), "partition_config.strict_mode"),
                           tuple(heads), tp_size=tp)
