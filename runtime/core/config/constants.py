"""`deepspeed.runtime.constants`: DeepSpeed's names for config keys and their defaults, for the
keys scripts read with the getters of `deepspeed.runtime.config` (getters.py). Each
default is the one dslaunch's config parser applies (__init__.py), which is DeepSpeed's."""
from . import DeepSpeedConfig

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = DeepSpeedConfig.from_dict({}).gradient_clipping
LOG_LEVEL = "log_level"
LOG_LEVEL_DEFAULT = DeepSpeedConfig.from_dict({}).log_level

__all__ = ["GRADIENT_CLIPPING", "GRADIENT_CLIPPING_DEFAULT", "LOG_LEVEL", "LOG_LEVEL_DEFAULT"]
