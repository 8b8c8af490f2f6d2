"""DeepSpeed's one-key config readers (`deepspeed.runtime.config.get_gradient_clipping(d)`):
a key of a config dict, parsed and checked as the whole config parses it, or its default
when absent."""
from __future__ import annotations

from typing import Any, Dict, Optional


def _parsed(param_dict: Dict[str, Any], key: str):
    from . import DeepSpeedConfig

    section = {key: param_dict[key]} if key in param_dict else {}
    return getattr(DeepSpeedConfig.from_dict(section), key)


def get_gradient_clipping(param_dict: Dict[str, Any]) -> float:
    return _parsed(param_dict, "gradient_clipping")


def get_log_level(param_dict: Dict[str, Any]) -> Optional[str]:
    return _parsed(param_dict, "log_level")


__all__ = ["get_gradient_clipping", "get_log_level"]
