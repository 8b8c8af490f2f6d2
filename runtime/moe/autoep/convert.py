"""Swapping detected blocks for AutoEPMoELayer in place, and the way back to the Hugging Face
layout (the gathered model `save_pretrained` writes).

The swap keeps the block's router and shared expert modules themselves and replaces its experts
child with this rank's experts: expert-parallel rank r holds global experts r x local ..
(r + 1) x local - 1, sliced from the block's weights and split into w1 (gate), w3 (up) and w2
(down) whatever the source layout. It refuses, naming the block, anything it would otherwise
drop: a child or parameter of the block other than its router, experts and shared expert, or
expert state beyond the projection weights (expert biases, for example).

`hf_state_dict` is the inverse: every layer's experts all-gathered over its expert group and put
back under the block's own keys and layout, the rest of the state dict as it is. Its keys,
shapes and order are those of the model before the swap.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from ...core.config.expert_parallel import ExpertParallelConfig
from .detect import LayerSpec, expert_weight
from .experts import GroupedExperts
from .layer import AutoEPMoELayer
from .presets import AutoEPError


@dataclass(frozen=True)
class SourceLayout:
    """How the block's state dict looked: its keys in order, and the experts' keys and shapes."""

    keys: Tuple[str, ...]  # relative to the block
    expert_keys: Dict[str, Tuple[str, int]]  # experts' key -> (role w1|w2|w3|w13, expert index or -1)
    shapes: Dict[str, Tuple[int, ...]]


def _expert_state(spec: LayerSpec, experts: nn.Module) -> Tuple[Dict[str, Tuple[str, int]], List[str]]:
    """The experts child's state-dict keys -> their role, and the keys with no role."""
    roles: Dict[str, Tuple[str, int]] = {}
    names = {"w1": spec.w1, "w2": spec.w2}
    if spec.w3:
        names["w3"] = spec.w3
    if spec.storage == "fused_3d":
        for role, name in names.items():
            roles[name] = ("w13" if role == "w1" and spec.w3 is None else role, -1)
    else:
        for i, expert in enumerate(experts):
            ids = {id(p): k for k, p in expert.state_dict(keep_vars=True).items()}
            for role, name in names.items():
                key = ids[id(expert_weight(expert, name))]
                roles[f"{i}.{key}"] = ("w13" if role == "w1" and spec.w3 is None else role, i)
    extra = [k for k in experts.state_dict().keys() if k not in roles]
    return roles, extra


def _slices(spec: LayerSpec, experts: nn.Module, lo: int, hi: int) -> Tuple[torch.Tensor, ...]:
    """This rank's (w1, w2, w3) as [local, ffn, hidden], [local, hidden, ffn], [local, ffn, hidden]."""
    f = spec.ffn
    with torch.no_grad():
        if spec.storage == "module_list":
            w1 = torch.stack([expert_weight(experts[i], spec.w1).detach() for i in range(lo, hi)])
            w2 = torch.stack([expert_weight(experts[i], spec.w2).detach() for i in range(lo, hi)])
            w3 = torch.stack([expert_weight(experts[i], spec.w3).detach() for i in range(lo, hi)]) if spec.w3 else None
        else:
            w1 = getattr(experts, spec.w1).detach()[lo:hi]
            w2 = getattr(experts, spec.w2).detach()[lo:hi]
            w3 = getattr(experts, spec.w3).detach()[lo:hi] if spec.w3 else None
        if spec.layout == "hidden_first":  # [E, H, 2F] and [E, F, H]
            w1, w2 = w1.transpose(1, 2), w2.transpose(1, 2)
        if w3 is None:
            w1, w3 = w1[:, :f], w1[:, f:]
        return tuple(t.clone().contiguous() for t in (w1, w2, w3))


def _requires_grad(spec: LayerSpec, experts: nn.Module) -> Tuple[bool, bool, bool]:
    if spec.storage == "module_list":
        flags = {name: {expert_weight(e, name).requires_grad for e in experts} for name in
                 (spec.w1, spec.w2) + ((spec.w3,) if spec.w3 else ())}
        for name, seen in flags.items():
            if len(seen) > 1:
                raise AutoEPError(f"expert_parallel: AutoEP cannot split '{spec.name}': its experts' '{name}' "
                                  "weights mix trainable and frozen ones, and they are stacked into one tensor")
        get = {n: seen.pop() for n, seen in flags.items()}
    else:
        get = {n: getattr(experts, n).requires_grad for n in (spec.w1, spec.w2) + ((spec.w3,) if spec.w3 else ())}
    return get[spec.w1], get[spec.w2], get[spec.w3] if spec.w3 else get[spec.w1]


def swap(model: nn.Module, specs: List[LayerSpec], cfg: ExpertParallelConfig, ep_size: int, ep_rank: int,
         ep_group) -> Dict[int, List[nn.Parameter]]:
    """Replace every block of `specs` in `model`; returns id(parameter dropped) -> the parameters
    that took its place on this rank (empty for another rank's experts)."""
    for spec in specs:  # everything refusable is refused before the first block changes
        _check_block(spec, model.get_submodule(spec.name))
    replaced: Dict[int, List[nn.Parameter]] = {}
    for spec in specs:
        parent_name, _, child = spec.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        block = getattr(parent, child)
        source = getattr(block, spec.experts_name)
        local = spec.num_experts // ep_size
        lo, hi = ep_rank * local, (ep_rank + 1) * local
        w1, w2, w3 = _slices(spec, source, lo, hi)
        experts = GroupedExperts(w1, w2, w3, spec.activation, spec.alpha, spec.limit, cfg.use_grouped_mm,
                                 cfg.gate_up_impl == "fused")
        for p, flag in zip((experts.w1, experts.w2, experts.w3), _requires_grad(spec, source)):
            p.requires_grad_(flag)
        layer = AutoEPMoELayer(
            spec, getattr(block, spec.router_name), experts, ep_size, ep_rank, ep_group,
            shared=getattr(block, spec.shared_experts_name) if spec.shared_experts_name else None,
            shared_gate=getattr(block, spec.shared_experts_gate_name) if spec.shared_experts_gate_name else None,
            combine_impl="legacy_bmm" if cfg.combine_impl == "legacy_bmm" else "weighted_sum")
        if spec.correction_bias_path == "":  # the bias on the block itself stays on the layer, same name
            _keep_bias(block, layer)
        roles, _ = _expert_state(spec, source)
        sd = block.state_dict()
        layer.source_layout = SourceLayout(
            keys=tuple(sd.keys()), expert_keys={f"{spec.experts_name}.{k}": v for k, v in roles.items()},
            shapes={k: tuple(v.shape) for k, v in sd.items()})
        layer.train(block.training)
        for key, (role, index) in roles.items():
            param = _source_param(spec, source, key, role, index)
            if param is None:
                continue
            mine = spec.storage == "fused_3d" or lo <= index < hi
            new = {"w13": [experts.w1, experts.w3], "w1": [experts.w1], "w2": [experts.w2],
                   "w3": [experts.w3]}[role] if mine else []
            replaced.setdefault(id(param), [])
            replaced[id(param)] += [p for p in new if all(p is not q for q in replaced[id(param)])]
        setattr(parent, child, layer)
    return replaced


def _source_param(spec: LayerSpec, source: nn.Module, key: str, role: str, index: int) -> Optional[nn.Parameter]:
    name = {"w13": spec.w1, "w1": spec.w1, "w2": spec.w2, "w3": spec.w3}[role]
    p = expert_weight(source[index], name) if spec.storage == "module_list" else getattr(source, name)
    return p if isinstance(p, nn.Parameter) else None


def _keep_bias(block: nn.Module, layer: nn.Module) -> None:
    bias = block.e_score_correction_bias
    if isinstance(bias, nn.Parameter):
        layer.e_score_correction_bias = bias
    else:
        layer.register_buffer("e_score_correction_bias", bias,
                              persistent="e_score_correction_bias" not in block._non_persistent_buffers_set)


def _check_block(spec: LayerSpec, block: nn.Module) -> None:
    kept = {spec.router_name, spec.experts_name, spec.shared_experts_name, spec.shared_experts_gate_name} - {""}
    cannot = f"expert_parallel: AutoEP cannot split '{spec.name}' ({type(block).__name__})"
    for name, _ in block.named_children():
        if name not in kept:
            raise AutoEPError(f"{cannot}: it has a child '{name}' besides its router, experts and shared expert, "
                              "which the expert-parallel layer would drop")
    own = [n for n, _ in block.named_parameters(recurse=False)] + \
          [n for n, _ in block.named_buffers(recurse=False) if n != "e_score_correction_bias"]
    if own:
        raise AutoEPError(f"{cannot}: it holds '{own[0]}' itself, which the expert-parallel layer would drop")
    path = spec.correction_bias_path
    if path is not None and path != "" and path.split(".")[0] not in kept - {spec.experts_name}:
        raise AutoEPError(f"{cannot}: its e_score_correction_bias is in '{path}', which the expert-parallel layer "
                          "replaces")
    _, extra = _expert_state(spec, getattr(block, spec.experts_name))
    if extra:
        raise AutoEPError(f"{cannot}: its experts hold '{extra[0]}' besides the projection weights "
                          f"{', '.join(n for n in (spec.w1, spec.w3, spec.w2) if n)}, which AutoEP does not carry")


def autoep_layers(module: nn.Module) -> List[Tuple[str, AutoEPMoELayer]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, AutoEPMoELayer)]


def _gathered(layer: AutoEPMoELayer, p: torch.Tensor) -> torch.Tensor:
    from ...core import comm

    local = p.detach().contiguous()
    if layer.ep_size == 1:
        return local.to("cpu", copy=True)
    out = local.new_empty((layer.ep_size * local.shape[0],) + tuple(local.shape[1:]))
    comm.all_gather_into_tensor(out, local, group=layer.ep_group, label=f"autoep gather {layer.spec.name}")
    return out.to("cpu")


def _rebuild(layer: AutoEPMoELayer, full: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The block's expert weight `key` from the gathered w1, w2, w3 ([experts, ...])."""
    spec, (role, index) = layer.spec, layer.source_layout.expert_keys[key]
    w1, w2, w3 = full["w1"], full["w2"], full["w3"]
    if spec.storage == "module_list":
        return {"w13": lambda: torch.cat([w1[index], w3[index]]), "w1": lambda: w1[index], "w2": lambda: w2[index],
                "w3": lambda: w3[index]}[role]().clone()
    value = {"w13": lambda: torch.cat([w1, w3], dim=1), "w1": lambda: w1, "w2": lambda: w2, "w3": lambda: w3}[role]()
    if spec.layout == "hidden_first":
        value = value.transpose(1, 2)
    return value.contiguous()


def hf_state_dict(module: nn.Module, exclude_frozen: bool = False) -> Optional[Dict[str, torch.Tensor]]:
    """Collective over rank 0's expert-parallel group (the other ranks call it too and get None):
    the state dict of the model before the swap, with the experts trained here, on CPU, on rank 0.
    `exclude_frozen`: without the parameters that do not train (requires_grad false)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    layers = autoep_layers(module)
    if rank != 0 and not any(_holds_rank0(layer) for _, layer in layers):
        return None
    full = {name: {w: _gathered(layer, getattr(layer.experts, w)) for w in ("w1", "w2", "w3")}
            for name, layer in layers}
    if rank != 0:
        return None
    by_name = dict(layers)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} if exclude_frozen else set()
    out: Dict[str, torch.Tensor] = OrderedDict()
    done = set()
    for key, value in module.state_dict().items():
        owner = next((n for n in by_name if key.startswith(n + ".")), None)
        if owner is None:
            if key not in frozen:
                out[key] = value.detach().to("cpu", copy=True)
            continue
        if owner in done:
            continue
        done.add(owner)
        layer = by_name[owner]
        local = layer.state_dict()
        for rel in layer.source_layout.keys:
            if rel in layer.source_layout.expert_keys:
                role = layer.source_layout.expert_keys[rel][0]
                if f"{owner}.experts.{'w1' if role == 'w13' else role}" not in frozen:
                    out[f"{owner}.{rel}"] = _rebuild(layer, full[owner], rel)
            elif f"{owner}.{rel}" not in frozen:
                out[f"{owner}.{rel}"] = local[rel].detach().to("cpu", copy=True)
    return out


def _holds_rank0(layer: AutoEPMoELayer) -> bool:
    """Whether this rank is in global rank 0's expert group (the ranks that gather for it)."""
    from ...core import comm

    return layer.ep_size > 1 and 0 in comm.get_all_ranks_from_group(layer.ep_group)
