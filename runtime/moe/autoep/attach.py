"""AutoEP at deepspeed.initialize: what the engine calls, in its order.

    plan(config, model, mpu, world)   before the mesh: every refusal (the layout, the model's
                                      blocks), and the mesh's expert-axis size
    attach(plan, mesh, ...)           after it: the blocks swapped on this rank, and a client
                                      optimizer or parameter list pointed at the new parameters

What AutoEP does not do here, each one line (exit 2): ZeRO stage 3 and offload (DeepSpeed
0.19.8 partitions experts over their expert-data group at stage 3; here "moe" groups need
stages 0-2 without offload), AutoTP folding (tensor_parallel.autotp_size > 1), Ulysses sequence
parallelism, a pipeline or an mpu, a model that also has deepspeed.moe layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .convert import swap
from .detect import LayerSpec, check_split, detect
from .experts import grouped_mm_problem
from .presets import AutoEPError


@dataclass
class Plan:
    specs: List[LayerSpec]
    ep_size: int


def _dtype(config) -> torch.dtype:
    return torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else torch.float32


def plan(config, model: nn.Module, mpu, world: int, native_moe: bool) -> Plan:
    """The checks that need no process group; AutoEPError names what is refused."""
    cfg = config.expert_parallel
    ep = cfg.autoep_size
    if getattr(model, "parallel_mesh", None) is not None or mpu is not None:
        raise AutoEPError("expert_parallel: AutoEP with a pipeline or an mpu is not supported; the expert axis is "
                          "built over plain data parallelism")
    if config.tensor_parallel.size > 1:
        raise AutoEPError(f"expert_parallel: AutoEP with tensor_parallel.autotp_size {config.tensor_parallel.size} "
                          "(AutoEP+AutoTP folding) is not supported; use one of them")
    if config.sequence_parallel_size > 1:
        raise AutoEPError(f"expert_parallel: AutoEP with sequence_parallel_size {config.sequence_parallel_size} is "
                          "not supported")
    if config.zero_optimization.stage == 3:
        raise AutoEPError("expert_parallel: AutoEP at ZeRO stage 3 is not supported (DeepSpeed 0.19.8 partitions each "
                          "expert over its expert-data-parallel group; here expert parameters need stage 0, 1 or 2)")
    if config.zero_optimization.offload_optimizer_device != "none" or config.zero_optimization.offload_param_device != "none":
        raise AutoEPError("expert_parallel: AutoEP with ZeRO offload is not supported (expert parameters reduce over "
                          "their expert-data-parallel group, which the offloaded optimizer does not); remove the "
                          "offload section")
    if native_moe:
        raise AutoEPError("expert_parallel: AutoEP in a model that also has deepspeed.moe layers is not supported; "
                          "use one of them")
    if world % ep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise AutoEPError(f"expert_parallel: expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size "
                          f"({ep} * 1 = {ep}) must divide the world size {world}. Valid expert-width values: "
                          f"{divisors}")
    specs = detect(model, cfg)
    check_split(specs, ep)
    if cfg.use_grouped_mm:
        for spec in specs:
            why = grouped_mm_problem(spec.hidden, spec.ffn, _dtype(config))
            if why is not None:
                raise AutoEPError(f"expert_parallel.use_grouped_mm: torch._grouped_mm cannot run the experts of "
                                  f"'{spec.name}': {why}; set use_grouped_mm false (one matmul per expert)")
    return Plan(specs, ep)


def attach(p: Plan, config, model: nn.Module, mesh, optimizer, model_parameters):
    """Swap the blocks on this rank; returns (optimizer, model_parameters) pointing at the new
    parameters. A client torch optimizer keeps its groups: each group loses the dropped expert
    weights, and this rank's new experts join a "moe" group copied from their source's group
    (gradients of expert parameters are reduced over their expert-data-parallel group only)."""
    ep = p.ep_size
    group = mesh.group("expert") if ep > 1 else None
    rank = mesh.rank("expert") if ep > 1 else 0
    if isinstance(optimizer, torch.optim.Optimizer) and any(len(s) for s in optimizer.state.values()):
        raise AutoEPError("initialize(optimizer=...): the optimizer already holds state; with AutoEP create it before "
                          "any step (the expert weights are replaced by this rank's share)")
    replaced = swap(model, p.specs, config.expert_parallel, ep, rank, group)
    if isinstance(optimizer, torch.optim.Optimizer):
        _remap_optimizer(optimizer, replaced)
    if model_parameters is not None:
        model_parameters = _remap_parameters(list(model_parameters), replaced)
    return optimizer, model_parameters


def _split(params: List[Any], replaced: Dict[int, List[nn.Parameter]]) -> Tuple[List[Any], List[nn.Parameter]]:
    """(params with the dropped ones removed, the new expert parameters their sources led to)."""
    kept, new = [], []
    for q in params:
        if id(q) in replaced:
            new += [r for r in replaced[id(q)] if all(r is not s for s in new)]
        else:
            kept.append(q)
    return kept, new


def _remap_optimizer(optimizer: torch.optim.Optimizer, replaced) -> None:
    for g in list(optimizer.param_groups):
        kept, new = _split(g["params"], replaced)
        g["params"] = kept
        if new:
            name = new[0].group_name
            optimizer.add_param_group({**{k: v for k, v in g.items() if k != "params"}, "params": new, "moe": True,
                                       "name": name})


def _remap_parameters(items: List[Any], replaced) -> List[Any]:
    if items and isinstance(items[0], dict):
        out = []
        for g in items:
            kept, new = _split(list(g["params"]), replaced)
            out.append(dict(g, params=kept + new))  # the engine's configure_moe_param_groups splits them
        return out
    kept, new = _split(items, replaced)
    return kept + new
