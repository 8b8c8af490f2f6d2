"""The tensor-parallel process group: from the caller, from a topology grid, or made here.

Where the group comes from, in order:
1. `tensor_parallel={"tp_group": group}`: that group;
2. `mpu=` / `tensor_parallel={"mpu": grid}`: a topology grid's (runtime/core/parallel/
   PipelineParallelGrid) tensor-parallel axis, or a Megatron-style mpu's model-parallel group;
3. otherwise the `model` axis of PipeModelDataParallelTopology(num_pp=1, num_mp=tp_size,
   num_dp=world/tp_size): tp_size consecutive ranks, all ranks when tp_size is the world size,
   else world/tp_size groups side by side, each serving a full copy of the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .config import InferenceConfig, InferenceConfigError


@dataclass
class TPGroup:
    group: Any  # a ProcessGroup (dist.group.WORLD included); None when size == 1
    size: int
    rank: int
    source: str  # said in the log line and in errors


def _from_mpu(mpu) -> Any:
    for name in ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group"):
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    raise InferenceConfigError("init_inference: mpu has no get_model_parallel_group()")


def resolve_tp_group(cfg: InferenceConfig) -> TPGroup:
    tp = cfg.tensor_parallel
    wanted = cfg.tp_size
    if tp.tp_group is not None or tp.mpu is not None:
        group = tp.tp_group if tp.tp_group is not None else _from_mpu(tp.mpu)
        source = "tensor_parallel.tp_group" if tp.tp_group is not None else "the mpu's model-parallel axis"
        if not dist.is_initialized():
            raise InferenceConfigError(f"init_inference: {source} given but torch.distributed is not initialised")
        size = dist.get_world_size(group=group)
        if wanted not in (1, size):
            raise InferenceConfigError(f"init_inference: tp_size={wanted} but {source} has {size} ranks")
        return TPGroup(group if size > 1 else None, size, dist.get_rank(group=group), source)
    if wanted == 1:
        return TPGroup(None, 1, 0, "tp_size 1")
    if not dist.is_initialized():
        from ..core.comm import init_distributed

        init_distributed()
    world = dist.get_world_size()
    if world % wanted:
        raise InferenceConfigError(f"init_inference: tp_size={wanted} does not divide the world size {world}")
    from ..core.parallel import PipeModelDataParallelTopology, PipelineParallelGrid

    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=1, num_mp=wanted, num_dp=world // wanted))
    source = "all ranks" if wanted == world else f"topology model axis, {world // wanted} replicas of {wanted} ranks"
    return TPGroup(grid.get_slice_parallel_group(), wanted, grid.get_slice_parallel_rank(), source)
