"""The small helpers DeepSpeed keeps in `deepspeed.runtime.utils` that scripts call
directly: memory reports, moving nested tensors, seeding, and gradient-norm clipping that
knows about model-parallel parameters. Each is dslaunch's own, with DeepSpeed's signature.
"""
from __future__ import annotations

import gc
import math
import random
from typing import Any, Callable, Iterable, Optional, Union

import torch

from ..core import comm

GiB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message`, the accelerator's allocated/reserved memory (now and peak) and the
    host's used memory, on rank 0 only and only with force=True (DeepSpeed's contract: calls
    sprinkled through a model cost nothing until forced). Resets the peak counters."""
    if not force:
        return
    if comm.is_initialized() and comm.get_rank() != 0:
        return
    import psutil

    gc.collect()  # count only live objects in the host figure
    print(message)
    if torch.cuda.is_available():
        print(f"MA {torch.cuda.memory_allocated() / GiB:.2f} GB  Max_MA {torch.cuda.max_memory_allocated() / GiB:.2f} GB  "
              f"CA {torch.cuda.memory_reserved() / GiB:.2f} GB  Max_CA {torch.cuda.max_memory_reserved() / GiB:.2f} GB")
        torch.cuda.reset_peak_memory_stats()
    else:
        print("MA 0.00 GB  Max_MA 0.00 GB  CA 0.00 GB  Max_CA 0.00 GB  (no accelerator: host memory below)")
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / GiB:.2f} GB, percent = {vm.percent}%")


def move_to_device(item: Any, device, criterion_func: Optional[Callable[[Any], bool]] = None) -> Any:
    """Move the tensors in `item` (nested lists, tuples, dicts) that satisfy criterion_func
    to `device` in place (their storage changes, the tensor objects stay), as DeepSpeed does;
    with no criterion nothing is moved and containers are rebuilt around the same items."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def set_random_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (all devices)."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % (2 ** 32))  # numpy takes 32-bit seeds only
    torch.manual_seed(seed)


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """A parameter sliced across tensor-parallel ranks (each rank holds a different part)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def clip_grad_norm_(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2,
                    mpu=None) -> torch.Tensor:
    """Clip the gradients of `parameters` in place to a total norm of max_norm; returns the
    norm before clipping (a 0-dim tensor), as DeepSpeed does.

    With a Megatron-style `mpu` the norm spans its model-parallel group: sliced parameters
    count on every rank, replicated ones on model-parallel rank 0 only, so each element
    counts once. The norm is then averaged over the data-parallel group (the mpu's, else the
    world), as DeepSpeed does so that ranks holding different experts clip alike.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    mp_group = mpu.get_model_parallel_group() if mpu is not None else None
    counted = [p for p in params if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p)]
    if norm_type == math.inf:
        total = torch.stack([p.grad.detach().abs().max().float() for p in counted] or [torch.tensor(0.0)]).max()
        if mp_group is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=mp_group)
    else:
        total = torch.stack([p.grad.detach().float().norm(norm_type) for p in counted] or [torch.tensor(0.0)])
        total = total.pow(norm_type).sum()
        if mp_group is not None:
            comm.all_reduce(total, op=comm.ReduceOp.SUM, group=mp_group)
        total = total.pow(1.0 / norm_type)
    if comm.is_initialized():
        dp_group = mpu.get_data_parallel_group() if mpu is not None else comm.get_world_group()
        total = total / comm.get_world_size(group=dp_group)
        comm.all_reduce(total, op=comm.ReduceOp.SUM, group=dp_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device, p.grad.dtype))
    return total


def call_to_str(base: str, *args, **kwargs) -> str:
    """How a call reads in a log line: `call_to_str("f", 1, x=2)` is "f(1, x=2)"."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(parts)})"


def count_used_parameters_in_backward(parameters: Iterable[torch.Tensor]) -> int:
    """How many of `parameters` the backward now running will reach (their gradient
    accumulators, each counted once, that the autograd engine is set to execute). For a hook
    running inside that backward; outside one it raises, as DeepSpeed's does."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward must be called during backward execution")
    nodes = set()  # two parameters may share one accumulator: counted once
    for p in parameters:
        if not isinstance(p, torch.Tensor) or not p.requires_grad:
            continue
        with torch.enable_grad():  # backward hooks run without grad mode; the lookup needs it for leaves
            node = _get_grad_fn_or_grad_acc(p)
        if node is not None:
            nodes.add(node)
    return sum(int(torch._C._will_engine_execute_node(n)) for n in nodes)
