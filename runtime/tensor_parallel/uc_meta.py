"""AutoTP's universal-checkpoint metadata (DeepSpeed 0.19.8's deepspeed.module_inject.layers
helpers of the same role).

Every parameter an AutoTP layer owns carries one dict under DS_AUTOTP_UC_META with two readers:
its top-level fields say how to cut this rank's piece back out of a full tensor on restore
(train/checkpoint/autotp_restore.py); its nested "conversion" dict is the smaller view a
converter needs, which `collect_universal_checkpoint_info` turns into the model-level
UNIVERSAL_CHECKPOINT_INFO patterns. DeepSpeed 0.19.8 also publishes an "affine_map" layout
description next to the patterns; it is not produced here (a converter without it reads the
pattern lists, which are complete on their own).
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional

import torch
from torch import nn

from .uc_keys import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, DS_AUTOTP_UC_META, ORIGINAL_VOCAB_SIZE,
                      PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHARD_WIDTHS,
                      TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                      UNIVERSAL_CHECKPOINT_VERSION_VALUE, VOCABULARY_PARAMETER_PATTERNS)


def _tuple(value) -> Optional[tuple]:
    return None if value is None else tuple(value)


def build_conversion_meta(*, partition_type: str, partition_dim: Optional[int] = None, sub_param_shape=None,
                          sub_param_shard_widths=None, original_shape=None, is_bias: bool = False,
                          replicated: bool = False, unsupported_reason: Optional[str] = None) -> Dict[str, Any]:
    """What a converter needs of one parameter (no restore-only sizes)."""
    return {"partition_type": partition_type, "partition_dim": partition_dim,
            "sub_param_shape": _tuple(sub_param_shape), "sub_param_shard_widths": sub_param_shard_widths,
            "original_shape": _tuple(original_shape), "is_bias": is_bias, "replicated": replicated,
            "unsupported_reason": unsupported_reason}


def build_restore_meta(*, partition_type: str, partition_dim: Optional[int] = None, logical_shape=None,
                       output_shape=None, sub_param_shape=None, sub_param_sizes=None, sub_param_shard_widths=None,
                       partition_sizes=None, target_partition_shape=None, original_shape=None, is_bias: bool = False,
                       replicated: bool = False, unsupported_reason: Optional[str] = None) -> Dict[str, Any]:
    """The parameter's whole description: restore fields (shapes as tuples) plus the nested
    conversion view, stamped with the universal-checkpoint version that wrote it."""
    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            "partition_type": partition_type, "partition_dim": partition_dim,
            "logical_shape": _tuple(logical_shape), "output_shape": _tuple(output_shape),
            "sub_param_shape": _tuple(sub_param_shape), "sub_param_sizes": _tuple(sub_param_sizes),
            "sub_param_shard_widths": sub_param_shard_widths, "partition_sizes": _tuple(partition_sizes),
            "target_partition_shape": _tuple(target_partition_shape), "original_shape": _tuple(original_shape),
            "is_bias": is_bias, "replicated": replicated,
            "conversion": build_conversion_meta(partition_type=partition_type, partition_dim=partition_dim,
                                                sub_param_shape=sub_param_shape,
                                                sub_param_shard_widths=sub_param_shard_widths,
                                                original_shape=original_shape, is_bias=is_bias,
                                                replicated=replicated, unsupported_reason=unsupported_reason)}


def set_param_meta(param: Optional[torch.Tensor], **fields: Any) -> None:
    if param is not None:
        setattr(param, DS_AUTOTP_UC_META, build_restore_meta(**fields))


def conversion_meta(param: torch.Tensor) -> Optional[Dict[str, Any]]:
    meta = getattr(param, DS_AUTOTP_UC_META, None)
    return meta.get("conversion") if meta else None


def shape_before_zero3(param: torch.Tensor) -> tuple:
    """ZeRO-3 empties a partitioned parameter's data and keeps its shape as `ds_shape`."""
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(param.shape) if ds_shape is None else tuple(ds_shape)


def collect_universal_checkpoint_info(model: nn.Module) -> Dict[str, Any]:
    """The model-level universal-checkpoint info of an AutoTP model, one regex `^name$` per
    parameter: row-parallel weights, replicated parameters (a row layer's bias, and every
    parameter AutoTP left alone, which is the same on every rank), vocabulary-split embeddings and
    heads, per-sub-parameter layouts with their widths, and the layouts that cannot be described
    with why. Each layer refreshes its metadata first (`_mark_uc_metadata`), so a split changed
    after construction is what gets published. A tied alias is skipped: the checkpoint knows the
    parameter under its first name only."""
    first_name = {}
    for name, param in model.named_parameters():
        first_name.setdefault(id(param), name)
    row, replicated, vocab, sub_params, unsupported, widths = [], [], [], [], {}, {}
    vocab_size = None
    for module_name, module in model.named_modules():
        mark = getattr(module, "_mark_uc_metadata", None)
        if callable(mark):
            mark()
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if first_name.get(id(param)) != full:
                continue
            pattern = rf"^{re.escape(full)}$"
            conv = conversion_meta(param)
            if not conv:
                replicated.append(pattern)
                continue
            if conv.get("unsupported_reason"):
                unsupported[pattern] = conv["unsupported_reason"]
                continue
            if conv.get("replicated"):
                replicated.append(pattern)
            if conv.get("partition_type") == "row" and not conv.get("is_bias"):
                row.append(pattern)
            shape, dim = conv.get("original_shape"), conv.get("partition_dim")
            # a [vocab, hidden] table split by rows; a hidden-split (row) embedding is not vocabulary
            if shape and len(shape) == 2 and dim == 0 and ("embed" in full or "lm_head" in full):
                vocab.append(pattern)
                vocab_size = shape[0] if vocab_size is None else vocab_size
            spec = conv.get("sub_param_shape")
            if spec is not None and dim is not None:
                published = list(spec)
                shard_widths = conv.get("sub_param_shard_widths")
                if shard_widths is not None:
                    # the spec's split entry may be a *count* ((3, -1)); publish the real sizes
                    published[dim] = tuple(sum(w) for w in shard_widths)
                    widths[pattern] = [list(w) for w in shard_widths]
                sub_params.append({"patterns": [pattern], "shape": published, "partition_dim": dim})
    info: Dict[str, Any] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
                            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(set(row)),
                            TP_REPLICATED_PARAMETER_PATTERNS: sorted(set(replicated)),
                            VOCABULARY_PARAMETER_PATTERNS: sorted(set(vocab)),
                            PARAMETER_WITH_SUB_PARAMS: sub_params,
                            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: unsupported}
    if widths:
        info[SUB_PARAM_SHARD_WIDTHS] = widths
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info
