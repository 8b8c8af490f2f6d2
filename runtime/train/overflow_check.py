"""DeepSpeed's fp16 overflow check over parameter groups (`deepspeed.runtime.utils.CheckOverflow`)
and the weight norm it can work from (`get_weight_norm`), for scripts and optimizers written
against DeepSpeed's own fp16 wrappers. The engine's loss scaler does its own check
(core/loss_scaler.py); these are the script-facing helpers, with DeepSpeed's signatures.

Which ranks agree on an overflow follows DeepSpeed: the largest expert-parallel group when an
expert parameter is among those checked (a rank holding another expert may overflow alone),
the model-parallel group with an mpu, the world when gradients are reduce-scattered.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch

from ..core import comm
from ..core.loss_scaler import has_inf_or_nan
from ..core.parallel import groups
from ..moe.utils import is_moe_param
from .helpers import is_model_parallel_parameter


def get_weight_norm(parameters, norm_type=2, mpu=None) -> float:
    """The norm of the parameters' values (not their gradients) as one vector, summed over the
    mpu's model-parallel group (replicated parameters counted on tensor rank 0 only, pipeline
    replicas skipped); -1 when it is inf or NaN, which `CheckOverflow.check_using_norm` reads
    as an overflow."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    norm_type = float(norm_type)
    mp_group = mpu.get_model_parallel_group() if mpu is not None else None
    if norm_type == math.inf:
        total = torch.tensor([max((float(p.data.abs().max()) for p in parameters), default=0.0)])
        if mp_group is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mp_group)
        value = float(total[0])
    else:
        tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
        total = torch.zeros(1)
        for p in parameters:
            if getattr(p, "ds_pipe_replicated", False):
                continue  # a tied weight that another pipeline stage counts
            if tp_rank > 0 and not is_model_parallel_parameter(p):
                continue  # replicated over tensor ranks: rank 0 counts it
            total += p.data.float().norm(norm_type) ** norm_type
        if mp_group is not None:
            comm.all_reduce(total, op=comm.ReduceOp.SUM, group=mp_group)
        value = float(total[0]) ** (1.0 / norm_type)
    return -1 if math.isinf(value) or math.isnan(value) else value


class CheckOverflow:
    """Whether any gradient of the given parameter groups holds an inf or a NaN, agreed over
    the ranks that must skip the step together."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter: bool = False, deepspeed=None):
        self.mpu = mpu
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params: Optional[List[torch.Tensor]] = [p for g in param_groups for p in g] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or [])

    def check_using_norm(self, norm_group: Iterable[float], reduce_overflow: bool = True) -> bool:
        """From norms get_weight_norm computed: -1 among them is an overflow."""
        flag = torch.tensor([float(-1 in list(norm_group))])
        if self.has_moe_params:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=groups._get_max_expert_parallel_group())
        if self.mpu is not None:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=comm.get_world_group())
        return bool(flag[0])

    def check(self, param_groups=None) -> bool:
        if param_groups is None:
            if self.params is None:
                raise ValueError("CheckOverflow.check: no parameter groups, given neither here nor to the constructor")
            return self.has_overflow(self.params, has_moe_params=self.has_moe_params)
        params = [p for g in param_groups for p in g]
        return self.has_overflow(params, has_moe_params=any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and has_inf_or_nan(p.grad.data) for p in params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        flag = torch.tensor([int(self.has_overflow_serial(params))], dtype=torch.uint8)
        if has_moe_params:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=groups._get_max_expert_parallel_group())
        # an engine that does not all-reduce gradients in backward leaves each rank its own
        no_allreduce = self.deepspeed is not None and (
            getattr(self.deepspeed, "pipeline_enable_backward_allreduce", None) is False
            or getattr(self.deepspeed, "enable_backward_allreduce", True) is False)
        if self.zero_reduce_scatter:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=comm.get_world_group())
        elif self.mpu is not None:
            if no_allreduce:
                comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.mpu.get_data_parallel_group())
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        elif no_allreduce:
            comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=comm.get_world_group())
        return bool(flag[0])
