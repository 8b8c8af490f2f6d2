"""`deepspeed.runtime.precision_config`: the precision sections of a config dict, parsed.

DeepSpeed's scripts and tests read one section without building a whole config
(`get_bfloat16_config(cfg).enabled`); these parse it exactly as a full config would
(same checks, same defaults, the old "bfloat16" spelling included).
"""
from __future__ import annotations

from typing import Any, Dict

from .core.config import BF16Config, DeepSpeedConfig, FP16Config


def get_bfloat16_config(param_dict: Dict[str, Any]) -> BF16Config:
    section = {k: param_dict[k] for k in ("bf16", "bfloat16") if k in param_dict}
    return DeepSpeedConfig.from_dict(section).bf16


def get_float16_config(param_dict: Dict[str, Any]) -> FP16Config:
    section = {"fp16": param_dict["fp16"]} if "fp16" in param_dict else {}
    return DeepSpeedConfig.from_dict(section).fp16


__all__ = ["get_bfloat16_config", "get_float16_config"]
