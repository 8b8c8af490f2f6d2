"""DeepSpeed's MoE parameter helpers (`deepspeed.moe.utils`): telling expert parameters
apart and giving them their own optimizer param groups.

A param group marked `"moe": True` is reduced by the ZeRO strategies over the mesh's
`expert_data` axis (runtime/core/strategy.py); `split_params_into_different_moe_groups_for_optimizer`
makes those groups, one per expert group name, copying the original group's options.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple, Union

import torch
from torch import nn

from .layer import MoE, MoEError
from ..core.reduction import plan_buckets

ParamGroups = Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]]


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert's parameter (Experts marks them `allreduce = False`)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(model: nn.Module) -> Tuple[bool, int]:
    """(whether `model` has an MoE layer, the first one's num_experts)."""
    for m in model.modules():
        if isinstance(m, MoE):
            return True, m.num_experts
    return False, 0


def moe_layers(model: nn.Module) -> List[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


class NativeMoEStage3Error(MoEError, AssertionError):
    """deepspeed.moe layers spread over several ranks at ZeRO stage 3: an AssertionError as
    DeepSpeed's engine raises it (scripts and tests catch that type), and the one line to show."""


def refuse_native_moe_at_stage3(model: nn.Module, stage: int) -> None:
    """Stage 3 partitions every parameter over the one data-parallel group, and experts spread
    over an expert-parallel group would need their own: DeepSpeed refuses native MoE at stage 3
    with these words. A layer with ep_size 1 keeps every expert on every rank, so it needs no
    other group; it is left to stage 3's own checks (DeepSpeed refuses it too)."""
    if stage != 3:
        return
    for name, layer in model.named_modules():
        if isinstance(layer, MoE) and layer.ep_size > 1:
            raise NativeMoEStage3Error(f"Native DeepSpeed MoE is not supported with ZeRO Stage 3: '{name}' spreads its "
                                       f"experts over ep_size={layer.ep_size} ranks; choose ZeRO stage 1 or 2")


def expert_layers(model: nn.Module) -> List[nn.Module]:
    """The model's expert-parallel layers: deepspeed.moe MoE layers and AutoEP's layers."""
    from .autoep.layer import AutoEPMoELayer

    return [m for m in model.modules() if isinstance(m, (MoE, AutoEPMoELayer))]


def expert_parallel_size(model: nn.Module) -> int:
    """The ep_size of the model's MoE layers, AutoEP's included (1 without any); one line when
    they differ (one expert-parallel layout per engine here)."""
    sizes = sorted({m.ep_size for m in expert_layers(model)})
    if len(sizes) > 1:
        raise MoEError(f"MoE: layers with different ep_size {sizes} in one model are not supported; give every "
                       "MoE layer the same ep_size")
    return sizes[0] if sizes else 1


def check_moe_param_groups(optimizer, model: nn.Module, stage: int = 1):
    """`optimizer` itself, once its param groups are right for expert parallelism: with
    ep_size > 1 at ZeRO stage 1 or 2 every expert parameter must be in a `"moe": True` group
    (the group's partitions are reduced over the replicas of its expert, not over every rank)
    and a moe group must hold expert parameters only, as DeepSpeed's ZeRO optimizer requires.
    One line otherwise. At stage 0 each parameter reduces by what it is (zero/stage0.py), as in
    DeepSpeed, so any grouping trains."""
    if optimizer is None or expert_parallel_size(model) == 1 or stage == 0:
        return optimizer
    for g in optimizer.param_groups:
        moe = bool(g.get("moe", False))
        for p in g["params"]:
            if is_moe_param(p) != moe:
                what = "an expert parameter is in a param group without \"moe\": True" if not moe else \
                    "a \"moe\": True param group holds a non-expert parameter"
                raise MoEError(f"optimizer: {what}; build the groups with deepspeed.moe.utils."
                               "split_params_into_different_moe_groups_for_optimizer")
    return optimizer


def split_params_into_shared_and_expert_params(params: Sequence[nn.Parameter]):
    shared = [p for p in params if not is_moe_param(p)]
    experts = [p for p in params if is_moe_param(p)]
    return shared, experts


def split_params_grads_into_shared_and_expert_params(params: Sequence[nn.Parameter]):
    """The gradients (cast to their parameter's dtype) of shared and of expert parameters."""
    shared = [p.grad.to(p.dtype) for p in params if p.grad is not None and not is_moe_param(p)]
    experts = [p.grad.to(p.dtype) for p in params if p.grad is not None and is_moe_param(p)]
    return shared, experts


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: Union[int, float, None] = 178956971
                                                         ) -> List[Dict[str, Any]]:
    """Move expert parameters out of each group into groups marked `"moe": True` named after
    their expert group (`ep_size_N`), with the source group's other options; groups larger
    than `max_group_size` elements are cut. Every group needs a "name". Returns the list
    (the given groups, edited in place, then the new ones)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise TypeError(f"split_params_into_different_moe_groups_for_optimizer: param groups must be a dict, "
                        f"a tuple or a list, not {type(param_groups).__name__}")
    for g in param_groups:
        if "name" not in g:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: every param group needs a "
                             "\"name\" (the moe groups are named after it)")
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    new: List[Dict[str, Any]] = []
    for g in list(param_groups):
        params = list(g["params"])
        for name in names:
            mine = [p for p in params if is_moe_param(p) and p.group_name == name]
            for chunk in _cut(mine, max_group_size):
                new.append({**g, "name": name, "moe": True, "params": chunk})
        g["params"] = [p for p in params if not is_moe_param(p)]
    return param_groups + new


def _cut(params: List[nn.Parameter], limit) -> List[List[nn.Parameter]]:
    """Consecutive runs of at most `limit` elements: ZeRO's bucket rule, so a group is cut
    exactly where a bucket would be."""
    if limit is None:
        return [params]
    sizes = [getattr(p, "ds_numel", p.numel()) for p in params]
    return [[params[i] for i in bucket] for bucket in plan_buckets(sizes, int(limit))]


def is_moe_param_group(param_group: Dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def configure_moe_param_groups(model_parameters: List[Any]) -> List[Dict[str, Any]]:
    """Optimizer param groups for a model with MoE layers: a plain parameter list becomes a
    "dense-params" group plus moe groups; groups without any moe group are split; groups
    that already have one are returned as they are."""
    model_parameters = list(model_parameters)
    if not model_parameters:
        return model_parameters
    if isinstance(model_parameters[0], dict):
        if any("moe" in g for g in model_parameters):
            return model_parameters
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters, "name": "dense-params"})
