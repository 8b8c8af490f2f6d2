"""deepspeed.utils: DeepSpeed's grab-bag of helpers, each one dslaunch's own.

`logger` is the "dslaunch.runtime" logger (the HF Trainer sets its level); the ZeRO-3
leaf-module calls are dslaunch.runtime.zero.hook_scope's; the tensor-fragment calls
(safe_get_full_fp32_param and friends) are dslaunch.runtime.zero.fragments'.
"""
import logging

from dslaunch.runtime.comm import get_rank as _get_rank
from dslaunch.runtime.comm import is_initialized
from dslaunch.runtime.dataloader import RepeatingLoader
from dslaunch.runtime.zero.hook_scope import (
    get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
)
from dslaunch.runtime.zero.fragments import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
    safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

logger = logging.getLogger("dslaunch.runtime")


def log_dist(message: str, ranks=None, level: int = logging.INFO) -> None:
    """Log `message` on the listed ranks only (all ranks for None or [-1]), as DeepSpeed does."""
    rank = _get_rank()
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


__all__ = ["logger", "log_dist", "is_initialized", "RepeatingLoader", "set_z3_leaf_modules",
           "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_get_local_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized"]
