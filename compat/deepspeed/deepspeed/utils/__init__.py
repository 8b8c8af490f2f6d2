"""deepspeed.utils: DeepSpeed's grab-bag of helpers, each one dslaunch's own.

`logger` is the "dslaunch.runtime" logger (the HF Trainer sets its level); the ZeRO-3
leaf-module calls are dslaunch.runtime.zero.hook_scope's; the tensor-fragment calls
(safe_get_full_fp32_param and friends) are dslaunch.runtime.zero.fragments'.
"""
import logging as _logging

from dslaunch.runtime.core.comm import is_initialized
from dslaunch.runtime.train.dataloader import RepeatingLoader
from dslaunch.runtime.zero.hook_scope import (
    get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules, z3_leaf_module,
)
from dslaunch.runtime.zero.fragments import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
    safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

from dslaunch.runtime.train.compression.helper import recursive_getattr, recursive_setattr
from dslaunch.runtime.inference import OnDevice
from dslaunch.runtime.core.accelerator.nvtx import instrument_w_nvtx  # deepspeed.utils.nvtx's

logger = _logging.getLogger("dslaunch.runtime")


from dslaunch.runtime import log_dist  # noqa: E402  (one implementation for both import paths)

_logged_once = set()


def log_dist_once(message: str, ranks=None, level: int = _logging.INFO) -> None:
    """log_dist, each distinct (message, ranks, level) once per process."""
    key = (message, tuple(ranks) if ranks is not None else None, level)
    if key not in _logged_once:
        _logged_once.add(key)
        log_dist(message, ranks, level)


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Set the logger's level by name ("info", "WARNING", ...), as DeepSpeed's --log_level."""
    level = _logging.getLevelName(str(log_level_str).upper())
    if not isinstance(level, int):
        raise ValueError(f"log level {log_level_str!r}: expected debug, info, warning, error or critical")
    (custom_logger or logger).setLevel(level)


class DeprecatedException(Exception):
    pass


__all__ = ["logger", "log_dist", "log_dist_once", "is_initialized", "RepeatingLoader", "set_z3_leaf_modules",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules",
           "get_z3_leaf_modules", "z3_leaf_module", "OnDevice", "set_log_level_from_string",
           "recursive_getattr", "recursive_setattr", "instrument_w_nvtx", "DeprecatedException",
           "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_get_local_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized"]

# `deepspeed.utils.logging` is the submodule (DeepSpeed's logger module), not the standard library's
from . import logging  # noqa: E402,F401


def __getattr__(name):
    """DeepSpeed's deepspeed.utils submodules of dslaunch's alias table (`groups`, `timer`,
    `zero_to_fp32`, ...) as attributes, imported on first use: DeepSpeed's utils package imports
    them itself, so a script may reach `deepspeed.utils.groups` without importing it. The module
    is the one `import deepspeed.utils.<name>` gives; a refused entry, or no entry, is an absent
    attribute (hasattr() answers False)."""
    import importlib

    from dslaunch.compat import paths as _paths

    if name.startswith("_") or _paths.child(f"{_paths.PACKAGE}.utils", name) is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
