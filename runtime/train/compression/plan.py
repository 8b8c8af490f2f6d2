"""Which modules each technique of `compression_training` applies to, checked against the model.

Pure logic over `model.named_modules()`: module-name patterns are regular expressions searched in
the names (DeepSpeed's rule; "*" means every module the technique applies to). Every pattern
must match at least one module, a module belongs to at most one group per technique, and the
related modules of row and head pruning must fit the shapes they are cut with. Each problem is
one ConfigError line naming the config key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from torch import nn

from ...core.strict import ConfigError
from ...core.config.compression import CompressionConfig

# The layer types each technique applies to.
KINDS: Dict[str, Tuple[type, ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
    "activation_quantization": (nn.Linear, nn.Conv2d),
}
# The layer types a technique's related modules may be.
RELATED: Dict[str, Tuple[type, ...]] = {
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d, nn.BatchNorm2d),
}


@dataclass
class Target:
    """One module a technique applies to, with the group's params and its related modules."""

    technique: str
    group: str
    name: str
    params: object
    related: List[str] = field(default_factory=list)


def _regex(pattern: str, where: str):
    try:
        return re.compile(".*" if pattern == "*" else pattern)
    except re.error as exc:
        raise ConfigError(f"{where}: {pattern!r} is not a regular expression ({exc})") from None


def _match(model: nn.Module, pattern: str, kinds: Tuple[type, ...], where: str,
           excluded: Sequence = ()) -> List[str]:
    rx = _regex(pattern, where)
    names = [name for name, module in model.named_modules()
             if name and isinstance(module, kinds) and rx.search(name)
             and not any(x.search(name) for x in excluded)]
    if not names:
        kind = "/".join(k.__name__ for k in kinds)
        raise ConfigError(f"{where}: {pattern!r} matches no {kind} module of the model")
    return names


def plan(model: nn.Module, config: CompressionConfig) -> List[Target]:
    """The targets of every enabled technique, in DeepSpeed's order of application."""
    targets: List[Target] = []
    modules = dict(model.named_modules())
    for technique, section in config.techniques.items():
        path = f"compression_training.{technique}"
        shared = section.shared_parameters
        excluded = [_regex(p, f"{path}.shared_parameters.excluded_modules")
                    for p in getattr(shared, "excluded_modules", [])]
        owner: Dict[str, str] = {}
        for group_name, group in section.different_groups.items():
            where = f"{path}.different_groups.{group_name}"
            for i, pattern in enumerate(group.modules):
                names = _match(model, pattern, KINDS[technique], f"{where}.modules", excluded)
                related: List[List[str]] = []
                if group.related_modules is not None:
                    for rel in group.related_modules[i]:
                        found = _match(model, rel, RELATED[technique], f"{where}.related_modules")
                        if len(found) != len(names):
                            raise ConfigError(f"{where}.related_modules: {rel!r} matches {len(found)} modules but "
                                              f"{pattern!r} matches {len(names)}; they are paired in order")
                        related.append(found)
                for j, name in enumerate(names):
                    if name in owner:
                        raise ConfigError(f"{where}.modules: {name} is already in group {owner[name]!r} of "
                                          f"{technique}")
                    owner[name] = group_name
                    target = Target(technique, group_name, name, group.params, [r[j] for r in related])
                    _check_shapes(target, modules, shared, f"{where}.related_modules")
                    targets.append(target)
    return targets


def _check_shapes(target: Target, modules: Dict[str, nn.Module], shared, where: str) -> None:
    module = modules[target.name]
    if target.technique == "activation_quantization":
        return
    if target.technique == "weight_quantization":
        groups = module.weight.shape[0] if isinstance(module, nn.Embedding) else shared.quantize_groups
        if module.weight.shape[0] % groups:
            raise ConfigError(f"compression_training.weight_quantization.shared_parameters.quantize_groups: "
                              f"{groups} does not divide the {module.weight.shape[0]} rows of {target.name}")
        return
    if target.technique == "row_pruning":
        for rel in target.related:
            if modules[rel].in_features != module.out_features:
                raise ConfigError(f"{where}: {rel} takes {modules[rel].in_features} inputs, but {target.name} "
                                  f"gives {module.out_features} rows; they cannot be cut together")
    elif target.technique == "channel_pruning":
        for rel in target.related:
            other = modules[rel]
            fits = other.num_features if isinstance(other, nn.BatchNorm2d) else other.in_channels
            if fits != module.out_channels or getattr(other, "groups", 1) != 1:
                raise ConfigError(f"{where}: {rel} takes {fits} channels, but {target.name} gives "
                                  f"{module.out_channels}; they cannot be cut together")
    elif target.technique == "head_pruning":
        heads = shared.num_heads
        if module.in_features % heads:
            raise ConfigError(f"compression_training.head_pruning.shared_parameters.num_heads: {heads} does not "
                              f"divide the {module.in_features} inputs of {target.name}")
        for rel in target.related:
            if modules[rel].out_features != module.in_features:
                raise ConfigError(f"{where}: {rel} gives {modules[rel].out_features} outputs, but {target.name} "
                                  f"takes {module.in_features} ({heads} heads); they cannot be cut together")


def pruning_steps(shared, ratio: float) -> Tuple[List[int], List[float]]:
    """The steps at which a pruning technique prunes, and the dense ratio after each: sparse
    pruning goes from schedule_offset to schedule_offset_end every schedule_offset_stride steps
    in equal parts; the other techniques prune once, at schedule_offset."""
    start = shared.schedule_offset
    end: Optional[int] = getattr(shared, "schedule_offset_end", None)
    if end is None or end == start:
        return [start], [ratio]
    steps = list(range(start, end + 1, shared.schedule_offset_stride))
    if steps[-1] != end:
        steps.append(end)
    n = len(steps)
    return steps, [1.0 - (1.0 - ratio) * (i + 1) / n for i in range(n)]


def stack_of(model: nn.Module, prefix: str, where: str) -> nn.Module:
    """The ModuleList/Sequential that layer_reduction's module_name_prefix names."""
    stack = dict(model.named_modules()).get(prefix)
    if not isinstance(stack, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(f"{where}: {prefix!r} is not a ModuleList or Sequential of the model")
    return stack
