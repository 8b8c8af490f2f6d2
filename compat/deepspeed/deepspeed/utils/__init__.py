"""deepspeed.utils: DeepSpeed's grab-bag of helpers, each one dslaunch's own.

`logger` is the "dslaunch.runtime" logger (the HF Trainer sets its level); the ZeRO-3
leaf-module calls are dslaunch.runtime.zero.hook_scope's.
"""
import logging

from dslaunch.runtime.comm import is_initialized
from dslaunch.runtime.dataloader import RepeatingLoader
from dslaunch.runtime.zero.hook_scope import (
    get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
)

logger = logging.getLogger("dslaunch.runtime")


from dslaunch.runtime import log_dist  # noqa: E402  (one implementation for both import paths)


__all__ = ["logger", "log_dist", "is_initialized", "RepeatingLoader", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module"]
