"""DeepSpeed 0.19's `expert_parallel` section: AutoEP, which swaps a Hugging Face MoE model's
expert blocks for expert-parallel layers at initialize (runtime/moe/autoep/).

Every key DeepSpeed 0.19.8 reads (module_inject/auto_ep_config.py) is declared here with the
values it accepts; the checks DeepSpeed makes before it looks at the model are made here too,
with its wording where it has one. What needs the model (which blocks match, their expert
counts) is checked when the blocks are swapped. DeepSpeed reads the section with dict.get, so
a misspelt key is silently ignored there; here it is refused with the nearest key.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from ..strict import ConfigError, refused, supported
from .checks import positive

# The presets DeepSpeed 0.19.8 ships (auto_ep_presets/registry.py, in its order); the table
# itself is runtime/moe/autoep/presets.py, which checks that it names exactly these.
PRESET_NAMES = ("mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3")
# The expert MLP forms (DeepSpeed's EXPERT_ACTIVATIONS; runtime/moe/autoep/experts.py).
EXPERT_ACTIVATIONS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")


# `expert_w3` absent: the preset's choice, as opposed to null (gate and up fused in expert_w1). A
# string no Python attribute can be named, so the section stays plain data (to_dict, checkpoints).
UNSET = "<preset>"

DEEPEP = "DeepEP is not part of dslaunch (tokens move with all-to-all over the expert group)"
FOLDING = "only read by AutoEP + AutoTP folding, which is not supported here (AutoEP runs with tensor_parallel off)"
# DeepSpeed 0.19.8 refuses every non-null value too
LOAD_BALANCE = ("auxiliary-loss-free load balancing (a per-expert routing bias learned from the load) is not "
                "supported, as in DeepSpeed 0.19.8; set load_balance_coeff to null or remove it")


@dataclass
class ExpertParallelConfig:
    """DeepSpeed's `expert_parallel` section (AutoEP)."""

    enabled: bool = supported(False, "swap the model's MoE blocks for expert-parallel layers at initialize")
    autoep_size: int = supported(1, "expert-parallel degree: the ranks one copy of the experts is spread over (the mesh's "
                                    "expert axis); must divide the world and every MoE layer's expert count")
    expert_tensor_parallel_size: Any = refused(
        "reserved for expert-internal tensor parallelism, which DeepSpeed 0.19.8 does not support either; use 1", 1)
    validate_folding_routing: Any = refused(FOLDING, False)
    async_split_plan: Any = refused(
        "overlapping the split-size copy with token packing (CUDA streams) is not implemented; the split sizes are "
        "exchanged synchronously: remove it", False)
    preset_model: Optional[str] = supported(
        None, "mixtral, qwen3_moe (also Qwen2-MoE), qwen3_5_moe, deepseek_v2, deepseek_v3 or minimax_m3; default: "
              "from model.config.model_type")
    moe_layer_pattern: Optional[str] = supported(None, "regular expression the MoE blocks' module names fully match")
    expert_pattern: Optional[str] = supported(None, "name of the block's experts child")
    router_pattern: Optional[str] = supported(None, "name of the block's router child")
    use_grouped_mm: bool = supported(True, "experts run as torch._grouped_mm over all local experts (false: one "
                                           "matmul per expert)")
    disable_triton_grouped_mm: bool = supported(
        False, "no effect needed: dslaunch has no Triton grouped GEMM, torch._grouped_mm is always the grouped path")
    route_norm: Optional[bool] = supported(None, "normalise the top-k scores to sum 1 (default: model.config."
                                                 "norm_topk_prob, else the preset)")
    route_scale: float = supported(1.0, "the routing weights are multiplied by this (model.config."
                                        "routed_scaling_factor wins when the model has one)")
    score_apply: Literal["auto", "pre", "post"] = supported(
        "auto", "post: weight expert outputs by their scores; pre: weight the tokens before the experts")
    # Literal, not str: "auto" is one of DeepSpeed's values here, not a placeholder to resolve
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = supported("auto", "auto or weighted_sum: outputs x scores summed over top-k in fp32; "
                                          "legacy_bmm: the same sum as one batched matmul")
    row_weighting_impl: Literal["auto", "eager", "fused"] = supported("auto", "auto or eager (the only form without DeepEP)")
    gate_up_impl: Literal["separate", "fused"] = supported(
        "separate", "fused: the gate and up projections as one grouped matmul (needs use_grouped_mm)")
    comm_backend: str = supported("comm", "comm: all-to-all over the mesh's expert group (deepep refused)")
    comm_num_sm: Any = refused(f"only read by the DeepEP backend: {DEEPEP}; remove it", 12)
    comm_qp_margin: Any = refused(f"only read by the DeepEP backend: {DEEPEP}; remove it", 4)
    comm_max_tokens_per_rank: Any = refused(f"only read by the DeepEP backend: {DEEPEP}; remove it", 0)
    num_expert_groups: Optional[int] = supported(
        None, "group-limited routing: experts in this many groups (default: model.config.n_group)")
    num_limited_groups: Optional[int] = supported(
        None, "group-limited routing: tokens choose among this many groups (default: model.config.topk_group)")
    score_func: Literal["auto", "softmax", "sigmoid"] = supported(
        "auto", "router score function (default: model.config.scoring_func, else the preset)")
    top_k: Union[int, Literal["auto"]] = supported("auto", "experts per token (default: from model.config)")
    load_balance_coeff: Any = refused(LOAD_BALANCE, None)
    routed_scaling_factor: Union[float, Literal["auto"]] = supported(
        "auto", "overrides route_scale and model.config.routed_scaling_factor")
    expert_w1: Optional[str] = supported(None, "name of the experts' gate (or fused gate+up) weight")
    expert_w2: Optional[str] = supported(None, "name of the experts' down weight")
    expert_w3: Any = supported(UNSET, "name of the experts' up weight; null: gate and up fused in expert_w1")
    num_experts_attr: Optional[str] = supported(None, "model.config attribute holding the expert count")
    top_k_attr: Optional[str] = supported(None, "model.config attribute holding top-k")
    has_shared_experts: Optional[bool] = supported(None, "the block has a shared expert beside the routed ones")
    shared_experts_pattern: Optional[str] = supported(None, "name of the block's shared-expert child")
    shared_experts_gate_pattern: Optional[str] = supported(None, "name of the shared expert's sigmoid gate child")
    expert_activation: Optional[str] = supported(
        None, "swiglu, geglu_tanh, swiglu_clamped or swiglu_oai (default: the preset's, checked against the "
              "experts' act_fn)")

    def validate(self, path: str) -> None:
        key = (path + "." if path else "")
        positive(path, "autoep_size", self.autoep_size)
        if self.preset_model is not None and self.preset_model not in PRESET_NAMES:
            raise ConfigError(f"{key}preset_model: Unknown preset_model '{self.preset_model}'. Available presets: "
                              f"{list(PRESET_NAMES)}")
        if self.moe_layer_pattern is not None:
            try:
                re.compile(self.moe_layer_pattern)
            except re.error as exc:
                raise ConfigError(f"{key}moe_layer_pattern: not a regular expression ({exc})") from None
        if self.combine_impl == "fused_weighted_sum":
            raise ConfigError(f"{key}combine_impl: \"fused_weighted_sum\" runs DeepSpeed's Triton kernel, which "
                              "dslaunch does not have; use \"weighted_sum\" (the same sum) or leave it unset")
        if self.row_weighting_impl == "fused":
            raise ConfigError(f"{key}row_weighting_impl: row_weighting_impl=\"fused\" only runs inside the DeepEP "
                              f"route: {DEEPEP}; leave it unset")
        if self.comm_backend == "deepep":
            raise ConfigError(f"{key}comm_backend: \"deepep\" is not supported: {DEEPEP}; use \"comm\"")
        _one_of(key, "comm_backend", self.comm_backend, ("comm", "deepep"))
        if self.gate_up_impl == "fused" and not self.use_grouped_mm:
            raise ConfigError(f"{key}gate_up_impl: gate_up_impl=\"fused\" runs the gate and up projections as one "
                              "torch._grouped_mm, but use_grouped_mm=false selects the sequential expert loop. Set "
                              "use_grouped_mm=true, or leave gate_up_impl unset.")
        if self.expert_activation is not None and self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ConfigError(f"{key}expert_activation: expert_activation must be one of {EXPERT_ACTIVATIONS}, got "
                              f"'{self.expert_activation}'")
        for name in ("num_expert_groups", "num_limited_groups"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{key}{name}: {name} must be >= 1, got {value}")
        if self.num_expert_groups is not None and self.num_limited_groups is not None \
                and self.num_limited_groups > self.num_expert_groups:
            raise ConfigError(f"{key}num_limited_groups: num_limited_groups ({self.num_limited_groups}) must be <= "
                              f"num_expert_groups ({self.num_expert_groups})")
        if isinstance(self.top_k, int) and self.top_k < 1:
            raise ConfigError(f"{key}top_k: must be >= 1, got {self.top_k}")
        if isinstance(self.top_k, int) and self.top_k_attr is not None:
            # DeepSpeed warns that top_k_attr is then ignored: a key that does nothing is refused here
            raise ConfigError(f"{key}top_k_attr: ignored when top_k is a number ({self.top_k}); set one of the two")
        if not math.isfinite(self.route_scale):
            raise ConfigError(f"{key}route_scale: route_scale must be a finite number")
        if self.routed_scaling_factor != "auto" and not math.isfinite(self.routed_scaling_factor):
            raise ConfigError(f"{key}routed_scaling_factor: routed_scaling_factor must be a finite number")
        for name in ("expert_w1", "expert_w2", "num_experts_attr", "top_k_attr", "router_pattern", "expert_pattern",
                     "shared_experts_pattern", "shared_experts_gate_pattern"):
            _attr_name(key, name, getattr(self, name))
        if self.expert_w3 != UNSET and self.expert_w3 is not None:
            if not isinstance(self.expert_w3, str):
                raise ConfigError(f"{key}expert_w3: expected a string or null, got {self.expert_w3!r}")
            _attr_name(key, "expert_w3", self.expert_w3)
        if self.has_shared_experts is not True:
            # DeepSpeed warns "Pattern will be ignored": a key that does nothing is refused here
            for name in ("shared_experts_pattern", "shared_experts_gate_pattern"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{key}{name}: read only with has_shared_experts true; set that too, or "
                                      "remove it")


def _one_of(key: str, name: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}{name}: {name} must be one of {tuple(choices)}, got '{value}'")


def _attr_name(key: str, name: str, value) -> None:
    """DeepSpeed's rule for the names of children and config attributes: a direct attribute."""
    if value is None:
        return
    if value == "":
        raise ConfigError(f"{key}{name}: {name} must be a non-empty string")
    if "." in value:
        raise ConfigError(f"{key}{name}: {name} must be a direct attribute name (no dots)")
