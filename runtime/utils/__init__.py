"""dslaunch.runtime.utils: where a DeepSpeed script's `deepspeed.utils` imports land after
its import line becomes `dslaunch.runtime`. `zero_to_fp32` is the checkpoint package's
consolidation module (the script save_checkpoint ships), registered under this name too so
`from dslaunch.runtime.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint`
finds the same module object. The helpers DeepSpeed keeps in `deepspeed.runtime.utils`
(which the compatibility package maps here too) live in helpers.py and partitioned.py
(partition_balanced is the pipeline's layer partitioner, pipe/partition.py); the
tensor-fragment calls (safe_get_full_fp32_param and friends) are dslaunch.runtime.zero.fragments'.
"""
import sys

from ..checkpoint import zero_to_fp32
from ..zero.fragments import (
    safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state, safe_get_local_fp32_param,
    safe_get_local_grad, safe_get_local_optimizer_state, safe_set_full_fp32_param, safe_set_full_grad,
    safe_set_full_optimizer_state, safe_set_local_fp32_param, safe_set_local_grad, safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from .helpers import clip_grad_norm_, is_model_parallel_parameter, move_to_device, see_memory_usage, set_random_seed
from .partitioned import PartitionedTensor, partition_uniform, prefix_sum_inc
from ..pipe.partition import partition_balanced

sys.modules[__name__ + ".zero_to_fp32"] = zero_to_fp32

__all__ = ["zero_to_fp32", "clip_grad_norm_", "is_model_parallel_parameter", "move_to_device", "see_memory_usage",
           "set_random_seed", "PartitionedTensor", "partition_uniform", "partition_balanced", "prefix_sum_inc",
           "safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
           "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
           "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
           "safe_get_local_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized"]
