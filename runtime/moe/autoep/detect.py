"""Finding a model's MoE blocks and reading what AutoEP needs from each (DeepSpeed 0.19.8's
AutoEP.ep_parser and its post-detection checks).

A block is a module whose name fully matches the preset's `moe_layer_pattern` and that has the
preset's experts child (holding expert weights: 3-D parameters, or a ModuleList of expert MLPs)
and router child. Dense MLPs matching the same pattern (DeepSeek's first layers, Qwen-MoE's
mlp_only_layers) have no experts child and are left alone. For each block a LayerSpec records
where its weights are and how it routes, resolved as DeepSpeed resolves it:

    num_experts   model.config.<num_experts_attr>, checked against the router weight's rows
    top_k         the section's top_k, else model.config.<top_k_attr>
    score_func    the section's, else model.config.scoring_func, else the preset's
    route_norm    the section's, else model.config.norm_topk_prob, else the preset's
                  (DeepSeek-V2: the preset's, as its router never normalises)
    route_scale   the section's routed_scaling_factor, else model.config.routed_scaling_factor,
                  else route_scale
    groups        the section's num_expert_groups/num_limited_groups, else model.config.n_group/
                  topk_group (DeepSeek-V2: only with topk_method group_limited_greedy)

Anything that keeps a matched block from being split is refused in one line naming the block
(when a preset was chosen, by name or by model_type; when every preset is tried, a block one
preset cannot read is left to the others, as in DeepSpeed).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch
from torch import nn

from ...core.config.expert_parallel import ExpertParallelConfig
from .experts import ACTIVATIONS
from .presets import AutoEPError, Preset, candidates, known_model_type
from .routing import RoutingRule

log = logging.getLogger("dslaunch.runtime")


@dataclass(frozen=True)
class LayerSpec:
    name: str  # the block's module name
    family: str  # the preset
    router_name: str
    experts_name: str
    storage: str  # fused_3d | module_list
    w1: str
    w2: str
    w3: Optional[str]  # None: gate and up fused in w1
    layout: str  # gate_up_first | hidden_first (fused 3-D gate+up), separate
    hidden: int
    ffn: int
    routing: RoutingRule
    score_apply: str  # pre | post
    correction_bias_path: Optional[str]  # module path (in the block) of e_score_correction_bias
    shared_experts_name: str
    shared_experts_gate_name: str
    activation: str
    alpha: float
    limit: float

    @property
    def num_experts(self) -> int:
        return self.routing.num_experts

    @property
    def top_k(self) -> int:
        return self.routing.top_k


class _Skip(Exception):
    """This preset cannot read this block (left to the other presets, or refused)."""


def _shape(t) -> Tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))


@dataclass(frozen=True)
class FusedExpertLayout:
    """How a fused gate+up expert weight is laid out (deepspeed.moe.fused_expert_layout's
    classification): gate_up_first is [E, 2F, H] with down [E, H, F]; hidden_first is
    [E, H, 2F] with down [E, F, H] and needs a transpose to the former."""

    layout: str  # gate_up_first | hidden_first
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool


def classify_fused_gate_up_layout(w1_shape: Tuple[int, ...], w2_shape: Tuple[int, ...]) -> Optional[FusedExpertLayout]:
    """The layout of a fused gate+up weight of shape `w1_shape` and its down weight, read from
    the shapes alone; None when they are not 3-D or match neither layout."""
    w1, w2 = tuple(w1_shape), tuple(w2_shape)
    if len(w1) != 3 or len(w2) != 3:
        return None
    if w1[1] % 2 == 0 and w2[1:] == (w1[2], w1[1] // 2):
        return FusedExpertLayout("gate_up_first", w1[2], w1[1] // 2, False)
    if w1[2] % 2 == 0 and w2[1:] == (w1[2] // 2, w1[1]):
        return FusedExpertLayout("hidden_first", w1[1], w1[2] // 2, True)
    return None


def _fused_layout(w1: Tuple[int, ...], w2: Tuple[int, ...]) -> Optional[Tuple[str, int, int]]:
    """(layout, hidden, ffn) of a fused gate+up weight and its down weight (DeepSpeed's two layouts)."""
    found = classify_fused_gate_up_layout(w1, w2)
    return None if found is None else (found.layout, found.hidden_size, found.ffn_hidden_size)


def expert_weight(expert: nn.Module, name: str) -> Optional[torch.Tensor]:
    """An expert MLP's weight by name: a parameter, or a child Linear's weight."""
    value = getattr(expert, name, None)
    if isinstance(value, nn.Module):
        value = getattr(value, "weight", None)
    return value if isinstance(value, torch.Tensor) else None


def _deepseek_module_list(preset: Preset, experts: nn.Module) -> Preset:
    """DeepSeek-V3's adapter: remote-code models keep a ModuleList of gate/up/down MLPs."""
    if not isinstance(experts, nn.ModuleList) or not len(experts):
        return preset
    if (preset.expert_w1, preset.expert_w2, preset.expert_w3) != ("gate_up_proj", "down_proj", None):
        return preset
    if all(expert_weight(experts[0], n) is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return replace(preset, expert_w1="gate_proj", expert_w2="down_proj", expert_w3="up_proj")
    return preset


def _sizes(name: str, experts: nn.Module, preset: Preset, num_experts: int) -> Tuple[str, str, int, int]:
    """(storage, layout, hidden, ffn), or _Skip with the reason."""
    if isinstance(experts, nn.ModuleList):
        if len(experts) != num_experts:
            raise _Skip(f"its experts ModuleList holds {len(experts)} experts, the router {num_experts}")
        names = [preset.expert_w1, preset.expert_w2] + ([preset.expert_w3] if preset.expert_w3 else [])
        weights = []
        for i, expert in enumerate(experts):
            got = [expert_weight(expert, n) for n in names]
            missing = [n for n, w in zip(names, got) if w is None]
            if missing:
                raise _Skip(f"expert {i} has no weight {missing[0]!r}")
            weights.append(got)
        first = [_shape(w) for w in weights[0]]
        for i, ws in enumerate(weights):
            if [_shape(w) for w in ws] != first or len({(w.dtype, w.device) for w in ws + weights[0]}) > 1:
                raise _Skip(f"expert {i}'s weights differ in shape, dtype or device from expert 0's, and the experts "
                            "are stacked into one tensor per projection")
        w1, w2 = first[0], first[1]
        if len(w1) != 2 or len(w2) != 2:
            raise _Skip(f"expert weights {preset.expert_w1}/{preset.expert_w2} are not matrices")
        ffn = w1[0] if preset.expert_w3 else w1[0] // 2
        if preset.expert_w3 is None and w1[0] % 2:
            raise _Skip(f"fused gate+up weight {preset.expert_w1} {w1} has an odd number of rows")
        if w2 != (w1[1], ffn) or (preset.expert_w3 and first[2] != w1):
            raise _Skip(f"expert weight shapes {preset.expert_w1}={w1}, {preset.expert_w2}={w2} do not make a gated MLP")
        return "module_list", "separate" if preset.expert_w3 else "gate_up_first", w1[1], ffn
    w1, w2 = getattr(experts, preset.expert_w1, None), getattr(experts, preset.expert_w2, None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor):
        raise _Skip(f"its experts have no weights {preset.expert_w1!r} and {preset.expert_w2!r}")
    s1, s2 = _shape(w1), _shape(w2)
    if preset.expert_w3 is None:
        found = _fused_layout(s1, s2)
        if found is None:
            raise _Skip(f"expert_w3=None expects fused gate+up weights with either [E, 2*ffn, hidden]/[E, hidden, ffn] "
                        f"or [E, hidden, 2*ffn]/[E, ffn, hidden], but got {preset.expert_w1}={s1} and "
                        f"{preset.expert_w2}={s2}.")
        layout, hidden, ffn = found
    else:
        w3 = getattr(experts, preset.expert_w3, None)
        if not isinstance(w3, torch.Tensor):
            raise _Skip(f"expert_w3='{preset.expert_w3}' is set but no such weight exists on experts module.")
        if len(s1) != 3 or _shape(w3) != s1 or s2 != (s1[0], s1[2], s1[1]):
            raise _Skip(f"expert weight shapes {preset.expert_w1}={s1}, {preset.expert_w3}={_shape(w3)}, "
                        f"{preset.expert_w2}={s2} are not [E, ffn, hidden], [E, ffn, hidden], [E, hidden, ffn]")
        layout, hidden, ffn = "separate", s1[2], s1[1]
    if s1[0] != num_experts:
        raise _Skip(f"its experts hold {s1[0]} experts, the router {num_experts}")
    return "fused_3d", layout, hidden, ffn


def _clamp(experts: nn.Module, model_config) -> Optional[Tuple[Optional[float], float]]:
    """(alpha, limit) when the experts clamp their SwiGLU (DeepSpeed's test: a clamp limit on
    the experts or the config; hidden_act says "silu" for the clamped families too)."""
    owners = [experts, model_config]
    text = getattr(model_config, "get_text_config", None)
    if callable(text):
        owners.append(text())
    alpha = limit = None
    for owner in owners:
        if owner is None:
            continue
        limit = limit if limit is not None else getattr(owner, "swiglu_limit", None)
        alpha = alpha if alpha is not None else getattr(owner, "swiglu_alpha", None)
    if limit is None:
        own = getattr(experts, "limit", None)
        if isinstance(own, (int, float)) and not isinstance(own, bool):
            limit, alpha = own, getattr(experts, "alpha", None)
    return None if limit is None else (None if alpha is None else float(alpha), float(limit))


def _act_matches(experts: nn.Module) -> Optional[set]:
    act = getattr(experts, "act_fn", None)
    if act is None:
        return None
    probe = torch.linspace(-8.0, 8.0, steps=161)
    try:
        with torch.no_grad():
            seen = act(probe)
    except Exception:  # an act_fn that does not run on a CPU probe cannot be compared
        return None
    if not torch.is_tensor(seen) or seen.shape != probe.shape:
        return None
    return {n for n, a in ACTIVATIONS.items() if a.gate_fn is not None and torch.allclose(seen.float(), a.gate_fn(probe),
                                                                                         atol=1e-5)}


def _activation(cfg: ExpertParallelConfig, family: str, preset: Preset, experts: nn.Module, model_config,
                name: str) -> Tuple[str, float, float]:
    form, alpha, limit = preset.expert_activation, preset.expert_activation_alpha, preset.expert_activation_limit
    chosen = cfg.expert_activation is not None
    clamp = _clamp(experts, model_config)
    if clamp is not None:
        if not ACTIVATIONS[form].uses_limit and not chosen:
            raise AutoEPError(f"expert_parallel: the experts of '{name}' clamp their SwiGLU (limit={clamp[1]}), but "
                              f"preset '{family}' computes '{form}', which does not clamp; set "
                              "expert_parallel.expert_activation to the form the model uses (swiglu_clamped or "
                              f"swiglu_oai), or to \"{form}\" to keep the preset's on purpose")
        if ACTIVATIONS[form].uses_limit:
            limit = clamp[1]
            alpha = clamp[0] if clamp[0] is not None else alpha
    matches = _act_matches(experts)
    if matches is not None and ACTIVATIONS[form].gate_fn is not None and form not in matches and not chosen:
        seen = ", ".join(sorted(matches)) if matches else "none of the registered forms"
        raise AutoEPError(f"expert_parallel: the act_fn of the experts of '{name}' matches {seen}, but preset "
                          f"'{family}' computes '{form}', a different function; set expert_parallel.expert_activation "
                          f"to the form the model uses (one of {tuple(ACTIVATIONS)}), or to \"{form}\" to keep the "
                          "preset's on purpose")
    return form, alpha, limit


def _correction_bias_path(block: nn.Module, name: str) -> Optional[str]:
    found = [path for path, m in block.named_modules() if getattr(m, "e_score_correction_bias", None) is not None]
    if len(found) > 1:
        where = ", ".join(repr(p or "<root>") for p in found)
        raise AutoEPError(f"expert_parallel: AutoEP found e_score_correction_bias in multiple locations in layer "
                          f"'{name}': {where}; keep exactly one score correction bias in each MoE layer")
    return found[0] if found else None


def _group_rule(cfg: ExpertParallelConfig, preset: Preset, model_config) -> Tuple[Optional[int], Optional[int], str]:
    groups = cfg.num_expert_groups if cfg.num_expert_groups is not None else getattr(model_config, "n_group", None)
    limited = cfg.num_limited_groups if cfg.num_limited_groups is not None else getattr(model_config, "topk_group",
                                                                                          None)
    if preset.adapter == "deepseek_v2":
        if getattr(model_config, "topk_method", None) != "group_limited_greedy":
            # its router's greedy top-k ignores n_group/topk_group (DeepSpeed 0.19.8 back-fills them
            # anyway and then routes by groups, unlike the model: here only the section's keys do)
            return cfg.num_expert_groups, cfg.num_limited_groups, "top2_sum"
        return groups, limited, "max"
    return groups, limited, "top2_sum"


def _read_block(cfg: ExpertParallelConfig, family: str, preset: Preset, name: str, block: nn.Module,
                model_config) -> Optional[LayerSpec]:
    experts = getattr(block, preset.experts_pattern, None)
    if experts is None:
        return None  # a dense MLP under the same name
    if preset.adapter == "deepseek_v3":
        preset = _deepseek_module_list(preset, experts)
    w1 = getattr(experts, preset.expert_w1, None)
    if not isinstance(experts, nn.ModuleList) and not (isinstance(w1, torch.Tensor) and len(_shape(w1)) == 3):
        return None  # no expert weights: not an MoE block for this preset
    router = getattr(block, preset.router_pattern, None)
    if router is None:
        return None
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor) or len(_shape(weight)) != 2:
        raise _Skip(f"its router '{preset.router_pattern}' has no 2-D weight [experts, hidden]")
    num_experts, hidden_in = _shape(weight)
    from_config = getattr(model_config, preset.num_experts_attr, None) if model_config is not None else None
    if from_config is not None and from_config != num_experts:
        raise AutoEPError(f"expert_parallel: Config num_experts={from_config} mismatches router weight shape "
                          f"{tuple(_shape(weight))} (expected {num_experts}) in layer '{name}'")
    if isinstance(cfg.top_k, int):
        top_k = cfg.top_k
    else:
        top_k = getattr(model_config, preset.top_k_attr, None) if model_config is not None else None
        if top_k is None:
            raise AutoEPError(f"expert_parallel: Could not determine top_k for layer '{name}'. Set "
                              f"model.config.{preset.top_k_attr} or config top_k.")
    storage, layout, hidden, ffn = _sizes(name, experts, preset, num_experts)
    if hidden != hidden_in:
        raise AutoEPError(f"expert_parallel: hidden_size={hidden} from expert weights mismatches router weight "
                          f"dim={hidden_in} in '{name}'")
    if top_k > num_experts:
        raise AutoEPError(f"expert_parallel: top_k={top_k} exceeds num_experts={num_experts} in layer '{name}'")
    score_func = cfg.score_func if cfg.score_func != "auto" else (
        getattr(model_config, "scoring_func", None) if getattr(model_config, "scoring_func", None) in
        ("softmax", "sigmoid") else preset.score_func)
    if cfg.route_norm is not None:
        route_norm = cfg.route_norm
    elif preset.adapter != "deepseek_v2" and getattr(model_config, "norm_topk_prob", None) is not None:
        route_norm = bool(model_config.norm_topk_prob)
    else:
        route_norm = preset.route_norm
    if cfg.routed_scaling_factor != "auto":
        route_scale = float(cfg.routed_scaling_factor)
    elif getattr(model_config, "routed_scaling_factor", None) is not None:
        route_scale = float(model_config.routed_scaling_factor)
    else:
        route_scale = cfg.route_scale
    groups, limited, group_score = _group_rule(cfg, preset, model_config)
    _check_groups(name, num_experts, groups, limited, group_score)
    for attr, what in (("router_jitter_noise", "jitter"), ("router_z_loss_coef", "z-loss")):
        value = getattr(model_config, attr, 0.0) if model_config is not None else 0.0
        if value:
            # DeepSpeed warns and trains a different function than the model's; refused here
            raise AutoEPError(f"expert_parallel: model.config.{attr}={value}, but AutoEP's router does not implement "
                              f"{what} (layer '{name}'); set it to 0 to train with AutoEP")
    shared = shared_gate = ""
    if preset.has_shared_experts and preset.shared_experts_pattern:
        if getattr(block, preset.shared_experts_pattern, None) is not None:
            shared = preset.shared_experts_pattern
            if preset.shared_experts_gate_pattern and getattr(block, preset.shared_experts_gate_pattern, None) \
                    is not None:
                shared_gate = preset.shared_experts_gate_pattern
        elif cfg.has_shared_experts:
            raise AutoEPError(f"expert_parallel: has_shared_experts is true but layer '{name}' has no child "
                              f"'{preset.shared_experts_pattern}' (shared_experts_pattern)")
    elif cfg.has_shared_experts:
        raise AutoEPError("expert_parallel: has_shared_experts is true but no shared_experts_pattern names the "
                          f"shared expert of layer '{name}'; set shared_experts_pattern")
    activation, alpha, limit = _activation(cfg, family, preset, experts, model_config, name)
    return LayerSpec(
        name=name, family=family, router_name=preset.router_pattern, experts_name=preset.experts_pattern,
        storage=storage, w1=preset.expert_w1, w2=preset.expert_w2, w3=preset.expert_w3, layout=layout, hidden=hidden,
        ffn=ffn, routing=RoutingRule(num_experts=num_experts, top_k=top_k, score_func=score_func,
                                     route_norm=route_norm, route_scale=route_scale, num_expert_groups=groups,
                                     num_limited_groups=limited, group_score_func=group_score),
        score_apply=cfg.score_apply if cfg.score_apply != "auto" else preset.score_apply,
        correction_bias_path=_correction_bias_path(block, name), shared_experts_name=shared,
        shared_experts_gate_name=shared_gate, activation=activation, alpha=alpha, limit=limit)


def _check_groups(name: str, experts: int, groups: Optional[int], limited: Optional[int], score: str) -> None:
    if limited is not None and groups is None:
        raise AutoEPError(f"expert_parallel: num_limited_groups requires num_expert_groups to be set in layer '{name}'")
    if groups is None:
        return
    if groups < 1 or experts % groups:
        raise AutoEPError(f"expert_parallel: num_expert_groups ({groups}) must divide num_experts ({experts}) in "
                          f"layer '{name}'")
    if limited is None:
        raise AutoEPError(f"expert_parallel: num_limited_groups must be set when num_expert_groups is set in layer "
                          f"'{name}'")
    if not 1 <= limited <= groups:
        raise AutoEPError(f"expert_parallel: num_limited_groups ({limited}) must be between 1 and num_expert_groups "
                          f"({groups}) in layer '{name}'")
    if score == "top2_sum" and experts // groups < 2:
        raise AutoEPError(f"expert_parallel: experts_per_group ({experts // groups}) must be >= 2 (groups are scored "
                          f"by their top-2 sum) in layer '{name}'")


def detect(model: nn.Module, cfg: ExpertParallelConfig) -> List[LayerSpec]:
    """The MoE blocks of `model` and how each routes, or AutoEPError (module docstring)."""
    model_config = getattr(model, "config", None)
    tried = candidates(cfg, model_config)
    selected = cfg.preset_model is not None or cfg.moe_layer_pattern is not None or known_model_type(
        getattr(model_config, "model_type", None))
    specs: List[LayerSpec] = []
    for family, preset in tried:
        pattern = re.compile(preset.moe_layer_pattern)
        for name, block in model.named_modules():
            if not pattern.fullmatch(name):
                continue
            try:
                spec = _read_block(cfg, family, preset, name, block, model_config)
            except _Skip as why:
                if selected:
                    raise AutoEPError(f"expert_parallel: AutoEP cannot split '{name}' ({type(block).__name__}): preset "
                                      f"'{family}' matched it, but {why}") from None
                log.debug("AutoEP: preset %s skips %s: %s", family, name, why)
                continue
            if spec is not None:
                specs.append(spec)
    if not specs:
        source = (f"preset_model='{cfg.preset_model}'" if cfg.preset_model else
                  f"moe_layer_pattern='{cfg.moe_layer_pattern}'" if cfg.moe_layer_pattern else
                  f"model_type='{getattr(model_config, 'model_type', None)}'")
        shapes = {}
        for f, p in tried:  # the presets share their structure: one line per structure
            shapes.setdefault((p.moe_layer_pattern, p.router_pattern, p.experts_pattern), []).append(f)
        expected = "; ".join(f"{'/'.join(fs)}: moe_layer_pattern='{pat}', router='{r}', experts='{e}'"
                             for (pat, r, e), fs in shapes.items())
        # DeepSpeed only warns when no preset was chosen, and trains without AutoEP: refused here
        raise AutoEPError(f"expert_parallel: AutoEP found no MoE block in {type(model).__name__} for {source} "
                          f"(expected {expected}); choose a matching preset_model or give moe_layer_pattern, "
                          "router_pattern and expert_pattern")
    seen = {}
    for spec in specs:
        seen.setdefault(spec.name, []).append(spec.family)
    twice = {n: f for n, f in seen.items() if len(f) > 1}
    if twice:
        detail = "; ".join(f"{n}: {', '.join(f)}" for n, f in sorted(twice.items()))
        raise AutoEPError(f"expert_parallel: AutoEP detection is ambiguous and produced multiple replacement specs for "
                          f"the same MoE module(s): {detail}. Set expert_parallel.preset_model or provide custom AutoEP "
                          "patterns so each MoE module matches exactly one preset.")
    return specs


def check_split(specs: List[LayerSpec], ep_size: int) -> None:
    """Every block's experts must divide evenly over the expert-parallel ranks."""
    for spec in specs:
        n = spec.num_experts
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        if ep_size > n:
            raise AutoEPError(f"expert_parallel: autoep_size={ep_size} exceeds num_experts={n} in layer "
                              f"'{spec.name}'; each rank must own at least one expert (valid autoep_size values: "
                              f"{divisors})")
        if n % ep_size:
            raise AutoEPError(f"expert_parallel: num_experts={n} in layer '{spec.name}' is not divisible by "
                              f"autoep_size={ep_size} (valid autoep_size values: {divisors})")
