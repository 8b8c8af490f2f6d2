"""The model families AutoEP knows (DeepSpeed 0.19.8's presets), and how the `expert_parallel`
section's overrides and the model's config pick one.

A preset says where a family keeps its MoE blocks (a regular expression over module names), what
the block's router and experts children are called, how the expert weights are stored, which
model.config attributes give the expert count and top-k, and the family's routing: score
function, where the scores are applied, whether the top-k scores are normalised. Which preset a
model gets (`candidates`), as DeepSpeed decides it:

    preset_model set        that preset, with the section's overrides
    model.config.model_type the preset listing it (Qwen2-MoE is the qwen3_moe preset); a type a
                            preset names as unsupported is refused with the preset's note
    moe_layer_pattern set   a custom preset built from the section's keys
    otherwise               every preset is tried; a block more than one matches is ambiguous

OLMoE (model_type "olmoe") is no preset's: every preset matches its blocks, so DeepSpeed asks for
preset_model, and "mixtral" fits it (the norm_topk_prob of OLMoE's config turns normalisation off).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from ...core.config.expert_parallel import PRESET_NAMES, UNSET, ExpertParallelConfig
from ...core.strict import ConfigError


class AutoEPError(ConfigError):
    """Why AutoEP cannot swap this model's blocks, as the one line the user should see."""


@dataclass(frozen=True)
class Preset:
    moe_layer_pattern: str
    router_pattern: str
    experts_pattern: str
    expert_w1: str
    expert_w2: str
    expert_w3: Optional[str]  # None: gate and up fused in expert_w1
    num_experts_attr: str
    top_k_attr: str
    score_func: str  # softmax | sigmoid
    score_apply: str  # pre | post
    route_norm: bool
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    expert_activation: str = "swiglu"
    expert_activation_alpha: float = 1.702
    expert_activation_limit: float = 7.0
    # default: model.config.norm_topk_prob decides route_norm; "deepseek_v2": the preset does (its
    # router never normalises); group routing: "config" (the section, else n_group/topk_group),
    # "deepseek_v2" (only with topk_method group_limited_greedy, groups scored by their best expert)
    adapter: str = "default"
    hf_model_types: Tuple[str, ...] = ()
    unsupported_hf_model_type_notes: Dict[str, str] = field(default_factory=dict)
    min_transformers_version: Optional[str] = None


_FUSED = dict(moe_layer_pattern=r"model\.layers\.\d+\.mlp", router_pattern="gate", experts_pattern="experts",
              expert_w1="gate_up_proj", expert_w2="down_proj", expert_w3=None, top_k_attr="num_experts_per_tok",
              score_apply="post")

PRESETS: Dict[str, Preset] = {
    "mixtral": Preset(**_FUSED, num_experts_attr="num_local_experts", score_func="softmax", route_norm=True,
                      hf_model_types=("mixtral",), min_transformers_version="5.0.0"),
    "qwen3_moe": Preset(**_FUSED, num_experts_attr="num_experts", score_func="softmax", route_norm=True,
                        has_shared_experts=True, shared_experts_pattern="shared_expert",
                        shared_experts_gate_pattern="shared_expert_gate", hf_model_types=("qwen3_moe", "qwen2_moe"),
                        min_transformers_version="5.0.0"),
    "qwen3_5_moe": Preset(**_FUSED, num_experts_attr="num_experts", score_func="softmax", route_norm=True,
                          has_shared_experts=True, shared_experts_pattern="shared_expert",
                          shared_experts_gate_pattern="shared_expert_gate", hf_model_types=("qwen3_5_moe_text",),
                          unsupported_hf_model_type_notes={
                              "qwen3_5_moe": "AutoEP supports the Qwen3.5 text backbone preset path; pass the "
                                             "text-backbone model/config with model_type='qwen3_5_moe_text'."},
                          min_transformers_version="5.2.0"),
    "deepseek_v2": Preset(**_FUSED, num_experts_attr="n_routed_experts", score_func="softmax", route_norm=False,
                          has_shared_experts=True, shared_experts_pattern="shared_experts", adapter="deepseek_v2",
                          hf_model_types=("deepseek_v2",), min_transformers_version="5.0.0"),
    "deepseek_v3": Preset(**_FUSED, num_experts_attr="n_routed_experts", score_func="sigmoid", route_norm=False,
                          has_shared_experts=True, shared_experts_pattern="shared_experts", adapter="deepseek_v3",
                          hf_model_types=("deepseek_v3",), min_transformers_version="5.0.0"),
    "minimax_m3": Preset(**_FUSED, num_experts_attr="num_local_experts", score_func="sigmoid", route_norm=True,
                         has_shared_experts=True, shared_experts_pattern="shared_experts",
                         expert_activation="swiglu_oai", hf_model_types=("minimax_m3_vl_text",),
                         unsupported_hf_model_type_notes={
                             "minimax_m3_vl": "AutoEP replaces the MiniMax-M3 text backbone; pass the text-backbone "
                                              "model/config with model_type='minimax_m3_vl_text'."},
                         min_transformers_version="5.15.0"),
}
assert tuple(PRESETS) == PRESET_NAMES, "the config's preset names and this table must agree"


def preset_for_model_type(model_type: Optional[str]) -> Optional[str]:
    for name, preset in PRESETS.items():
        if model_type in preset.hf_model_types:
            return name
    return None


def _unsupported_note(model_type: Optional[str]) -> Optional[Tuple[str, Preset]]:
    for name, preset in PRESETS.items():
        if model_type in preset.unsupported_hf_model_type_notes:
            return name, preset
    return None


def known_model_type(model_type: Optional[str]) -> bool:
    return preset_for_model_type(model_type) is not None or _unsupported_note(model_type) is not None


def with_overrides(cfg: ExpertParallelConfig, preset: Preset) -> Preset:
    """The preset with the section's explicit overrides (DeepSpeed's apply_config_overrides)."""
    changes = {}
    for key, attr in (("moe_layer_pattern", "moe_layer_pattern"), ("router_pattern", "router_pattern"),
                      ("expert_pattern", "experts_pattern"), ("expert_w1", "expert_w1"), ("expert_w2", "expert_w2"),
                      ("num_experts_attr", "num_experts_attr"), ("top_k_attr", "top_k_attr"),
                      ("has_shared_experts", "has_shared_experts"), ("shared_experts_pattern", "shared_experts_pattern"),
                      ("shared_experts_gate_pattern", "shared_experts_gate_pattern"),
                      ("expert_activation", "expert_activation")):
        value = getattr(cfg, key)
        if value is not None:
            changes[attr] = value
    if cfg.expert_w3 != UNSET:
        changes["expert_w3"] = cfg.expert_w3
    return replace(preset, **changes) if changes else preset


def _custom(cfg: ExpertParallelConfig) -> Preset:
    """DeepSpeed's custom preset: the section's keys, with its defaults for the rest."""
    return Preset(moe_layer_pattern=cfg.moe_layer_pattern, router_pattern=cfg.router_pattern or "gate",
                  experts_pattern=cfg.expert_pattern or "experts", expert_w1=cfg.expert_w1 or "gate_up_proj",
                  expert_w2=cfg.expert_w2 or "down_proj", expert_w3=None if cfg.expert_w3 == UNSET else cfg.expert_w3,
                  num_experts_attr=cfg.num_experts_attr or "num_local_experts",
                  top_k_attr=cfg.top_k_attr or "num_experts_per_tok",
                  score_func=cfg.score_func if cfg.score_func != "auto" else "softmax",
                  score_apply=cfg.score_apply if cfg.score_apply != "auto" else "post",
                  route_norm=cfg.route_norm if cfg.route_norm is not None else True,
                  has_shared_experts=bool(cfg.has_shared_experts),
                  shared_experts_pattern=cfg.shared_experts_pattern or "",
                  shared_experts_gate_pattern=cfg.shared_experts_gate_pattern or "",
                  expert_activation=cfg.expert_activation or "swiglu")


def _check_compatible(name: str, preset: Preset, model_type: Optional[str]) -> None:
    if model_type is None:
        return
    note = preset.unsupported_hf_model_type_notes.get(model_type)
    if note is not None:
        supported = ", ".join(repr(t) for t in preset.hf_model_types) or "none"
        raise AutoEPError(f"expert_parallel: AutoEP preset '{name}' does not support model_type='{model_type}'. "
                          f"{note} Supported HF model_type value(s): {supported}.")
    if preset.min_transformers_version is None or model_type not in preset.hf_model_types:
        return
    try:
        import transformers
        from packaging.version import Version

        installed = transformers.__version__
        if Version(installed) < Version(preset.min_transformers_version):
            raise AutoEPError(f"expert_parallel: AutoEP preset '{name}' for model_type='{model_type}' requires "
                              f"Transformers >= {preset.min_transformers_version}, but installed "
                              f"transformers=={installed}")
    except ImportError:  # a model_type without transformers: a custom model that names itself alike
        return


def candidates(cfg: ExpertParallelConfig, model_config) -> List[Tuple[str, Preset]]:
    """The presets to try, in DeepSpeed's order of precedence (module docstring)."""
    model_type = getattr(model_config, "model_type", None) if model_config is not None else None
    if cfg.preset_model is not None:
        preset = with_overrides(cfg, PRESETS[cfg.preset_model])
        _check_compatible(cfg.preset_model, preset, model_type)
        return [(cfg.preset_model, preset)]
    if model_type:
        name = preset_for_model_type(model_type)
        if name is not None:
            preset = with_overrides(cfg, PRESETS[name])
            _check_compatible(name, preset, model_type)
            return [(name, preset)]
        unsupported = _unsupported_note(model_type)
        if unsupported is not None:
            _check_compatible(unsupported[0], unsupported[1], model_type)
    if cfg.moe_layer_pattern:
        return [("custom", _custom(cfg))]
    return [(name, with_overrides(cfg, preset)) for name, preset in PRESETS.items()]
