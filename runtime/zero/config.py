"""`deepspeed.runtime.zero.config`: DeepSpeed's names for the `zero_optimization` schema.

The schema itself is dslaunch's (runtime/config/zero.py, parsed strictly with every key
checked); scripts that build or read it under DeepSpeed's names get the same classes.
"""
from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any, Dict

from ..core.config.zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from ..core.strict import parse_dataclass



class _ParsedByName(type):
    """`DeepSpeedZeroConfig(**section)` builds the section as DeepSpeed's pydantic model does,
    taking every spelling it takes (stage3_ prefixes or not, the deprecated fp16 name), through
    the strict parser; an instance of ZeroConfig is an instance of it."""

    def __call__(cls, **section):
        return parse_dataclass(ZeroConfig, section, "zero_optimization")

    def __instancecheck__(cls, obj):
        return isinstance(obj, ZeroConfig)


class DeepSpeedZeroConfig(metaclass=_ParsedByName):
    """DeepSpeed's name for the `zero_optimization` section (dslaunch's ZeroConfig)."""


DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig


class ZeroStageEnum(IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def get_zero_config(param_dict: Dict[str, Any]) -> ZeroConfig:
    """The parsed `zero_optimization` section of a whole config dict (stage 0 if absent)."""
    section = param_dict.get("zero_optimization", {})
    if isinstance(section, bool):  # DeepSpeed's legacy `"zero_optimization": true` is stage 1
        section = {"stage": 1 if section else 0}
    return parse_dataclass(ZeroConfig, section, "zero_optimization")


__all__ = ["DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig",
           "ZeroStageEnum", "OffloadDeviceEnum", "get_zero_config"]
