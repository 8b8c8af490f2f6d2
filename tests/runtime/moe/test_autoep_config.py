"""AutoEP without processes: the `expert_parallel` section as DeepSpeed 0.19.8 reads it (what it
accepts, what is refused and why), how each model family's blocks are read (routing resolved as
DeepSpeed resolves it), what initialize refuses before any process group exists, and the swapped
layer itself on one process: its output and gradients equal the Hugging Face block's, and
hf_state_dict gives back the model's own state dict, for every family and expert layout.
The multi-rank training runs are tests/runtime/moe/test_autoep.py's."""
import copy
import dataclasses

import pytest
import torch

from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.config.expert_parallel import ExpertParallelConfig
from dslaunch.runtime.strict import ConfigError
from script_modules import load_script

fx = load_script("make_ds_autoep_fixtures")
MODELS = fx.EP_MODELS + fx.ONE_MODELS

# the keys DeepSpeed 0.19.8's parse_autoep_config reads (module_inject/auto_ep_config.py)
DS_KEYS = ("enabled autoep_size expert_tensor_parallel_size validate_folding_routing async_split_plan preset_model "
           "moe_layer_pattern expert_pattern router_pattern use_grouped_mm disable_triton_grouped_mm route_norm "
           "route_scale score_apply combine_impl row_weighting_impl gate_up_impl comm_backend comm_num_sm "
           "comm_qp_margin comm_max_tokens_per_rank num_expert_groups num_limited_groups score_func top_k "
           "load_balance_coeff routed_scaling_factor expert_w1 expert_w2 expert_w3 num_experts_attr top_k_attr "
           "has_shared_experts shared_experts_pattern shared_experts_gate_pattern expert_activation").split()


def load(section: dict) -> ExpertParallelConfig:
    return DeepSpeedConfig.load({"train_batch_size": 2, "expert_parallel": section}).expert_parallel


def refusal(section: dict) -> str:
    with pytest.raises(ConfigError) as err:
        load(section)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_every_key_deepspeed_reads_is_declared_and_nothing_else():
    assert sorted(f.name for f in dataclasses.fields(ExpertParallelConfig)) == sorted(DS_KEYS)


def test_defaults_are_deepspeeds():
    c = load({})
    assert (c.enabled, c.autoep_size, c.use_grouped_mm, c.route_scale, c.score_apply, c.combine_impl,
            c.gate_up_impl, c.comm_backend, c.score_func, c.top_k, c.routed_scaling_factor) == (
        False, 1, True, 1.0, "auto", "auto", "separate", "comm", "auto", "auto", "auto")
    full = load({"enabled": True, "autoep_size": 4, "preset_model": "deepseek_v3", "top_k": 2, "score_func": "sigmoid",
                 "route_norm": True, "routed_scaling_factor": 2.5, "num_expert_groups": 4, "num_limited_groups": 2,
                 "expert_w3": None, "combine_impl": "legacy_bmm", "gate_up_impl": "fused", "score_apply": "pre",
                 "has_shared_experts": True, "shared_experts_pattern": "shared_experts"})
    assert full.expert_w3 is None and full.top_k == 2 and full.routed_scaling_factor == 2.5


@pytest.mark.parametrize("section,words", [
    ({"comm_backend": "deepep"}, "\"deepep\" is not supported: DeepEP is not part of dslaunch"),
    ({"comm_num_sm": 24}, "only read by the DeepEP backend"),
    ({"comm_max_tokens_per_rank": 4096}, "only read by the DeepEP backend"),
    ({"row_weighting_impl": "fused"}, "only runs inside the DeepEP route"),
    ({"combine_impl": "fused_weighted_sum"}, "Triton kernel, which dslaunch does not have"),
    ({"combine_impl": "bmm"}, "combine_impl: \"bmm\" is not one of"),
    ({"load_balance_coeff": 0.001}, "set load_balance_coeff to null or remove it"),
    ({"expert_tensor_parallel_size": 2}, "reserved for expert-internal tensor parallelism"),
    ({"validate_folding_routing": True}, "AutoEP + AutoTP folding"),
    ({"async_split_plan": True}, "exchanged synchronously"),
    ({"preset_model": "llama"}, "Unknown preset_model 'llama'. Available presets: ['mixtral', 'qwen3_moe'"),
    ({"expert_activation": "relu"}, "expert_activation must be one of"),
    ({"gate_up_impl": "fused", "use_grouped_mm": False}, "use_grouped_mm=false selects the sequential expert loop"),
    ({"num_expert_groups": 2, "num_limited_groups": 3}, "must be <= num_expert_groups (2)"),
    ({"num_limited_groups": 0}, "num_limited_groups must be >= 1"),
    ({"expert_w1": "experts.w1"}, "must be a direct attribute name (no dots)"),
    ({"router_pattern": ""}, "must be a non-empty string"),
    ({"top_k": 2, "top_k_attr": "k"}, "ignored when top_k is a number"),
    ({"shared_experts_pattern": "shared"}, "read only with has_shared_experts true"),
    ({"moe_layer_pattern": "model.layers.(\\d+.mlp"}, "not a regular expression"),
    ({"autoep_size": 0}, "autoep_size: must be > 0"),
    ({"score_func": "relu"}, "is not one of 'auto', 'softmax', 'sigmoid'"),
    ({"autoep_sise": 2}, "unknown key; did you mean 'autoep_size'?"),
])
def test_refused_in_one_line(section, words):
    assert words in refusal(section)


def test_off_values_of_refused_keys_load():
    load({"comm_backend": "comm", "comm_num_sm": 12, "comm_qp_margin": 4, "comm_max_tokens_per_rank": 0,
          "load_balance_coeff": None, "expert_tensor_parallel_size": 1, "validate_folding_routing": False,
          "async_split_plan": False, "row_weighting_impl": "eager", "combine_impl": "weighted_sum"})


# -- initialize's checks before any process group (autoep.plan) -------------------------------------------


def _plan(model, section=None, world=2, extra=None, mpu=None, native=False):
    from dslaunch.runtime.moe import autoep

    raw = {"train_batch_size": 2 * world, "expert_parallel": dict({"enabled": True, "autoep_size": 2}, **(section or {}))}
    raw.update(extra or {})
    return autoep.plan(DeepSpeedConfig.load(raw), model, mpu, world, native)


@pytest.mark.parametrize("extra,words", [
    ({"zero_optimization": {"stage": 3}}, "AutoEP at ZeRO stage 3 is not supported"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "AutoEP with ZeRO offload"),
    ({"tensor_parallel": {"autotp_size": 2}}, "AutoEP+AutoTP folding"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size 2 is not supported"),
])
def test_layouts_autoep_does_not_run_on_are_refused(extra, words):
    with pytest.raises(ConfigError) as err:
        _plan(fx.make_model("mixtral"), extra=extra)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_autoep_size_must_divide_the_world_and_the_experts():
    with pytest.raises(ConfigError, match=r"\(3 \* 1 = 3\) must divide the world size 4"):
        _plan(fx.make_model("mixtral"), {"autoep_size": 3}, world=4)
    with pytest.raises(ConfigError, match="autoep_size=8 exceeds num_experts=4 in layer 'model.layers.0.mlp'"):
        _plan(fx.make_model("mixtral"), {"autoep_size": 8}, world=8)
    with pytest.raises(ConfigError, match="with a pipeline or an mpu is not supported"):
        _plan(fx.make_model("mixtral"), mpu=object())
    with pytest.raises(ConfigError, match="also has deepspeed.moe layers"):
        _plan(fx.make_model("mixtral"), native=True)


def test_grouped_mm_that_cannot_run_the_experts_is_refused():
    cfg = fx.hf_config("mixtral")
    cfg.intermediate_size = 22  # 88-byte fp32 rows
    model = fx.model_class("mixtral")(cfg)
    with pytest.raises(ConfigError, match="ffn size 22 in torch.float32 is 88 bytes; set use_grouped_mm false"):
        _plan(model)
    _plan(model, {"use_grouped_mm": False})


def _specs(name, section=None):
    from dslaunch.runtime.moe import autoep

    cfg = load(dict({"enabled": True}, **(section or {}), **({"preset_model": fx.PRESET[name]}
                                                               if name in fx.PRESET else {})))
    return autoep.detect(fx.make_model(name), cfg)


def test_each_family_routes_as_its_model_does():
    got = {m: _specs(m) for m in MODELS}
    names = {m: [s.name for s in specs] for m, specs in got.items()}
    assert names["mixtral"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert names["deepseek_v3"] == ["model.layers.1.mlp"]  # layer 0 is dense (first_k_dense_replace)
    r = {m: specs[-1].routing for m, specs in got.items()}
    assert (r["mixtral"].score_func, r["mixtral"].route_norm, r["mixtral"].route_scale) == ("softmax", True, 1.0)
    assert r["olmoe"].route_norm is False  # OLMoE's norm_topk_prob
    assert (r["deepseek_v3"].score_func, r["deepseek_v3"].route_norm, r["deepseek_v3"].route_scale,
            r["deepseek_v3"].num_expert_groups, r["deepseek_v3"].num_limited_groups) == ("sigmoid", True, 2.5, 2, 1)
    assert got["deepseek_v3"][0].correction_bias_path == "gate"
    assert (r["deepseek_v2"].route_norm, r["deepseek_v2"].route_scale, r["deepseek_v2"].num_expert_groups) == (
        False, 1.5, None)
    assert (got["qwen2_moe"][0].shared_experts_name, got["qwen2_moe"][0].shared_experts_gate_name) == (
        "shared_expert", "shared_expert_gate")
    assert got["qwen3_moe"][0].shared_experts_name == ""
    assert (got["minimax_m3"][0].activation, r["minimax_m3"].score_func) == ("swiglu_oai", "sigmoid")
    assert {s.family for specs in got.values() for s in specs} >= {"mixtral", "qwen3_moe", "qwen3_5_moe",
                                                                   "deepseek_v2", "deepseek_v3", "minimax_m3"}


def test_what_cannot_be_split_is_refused_naming_the_block():
    from dslaunch.runtime.moe import autoep

    model = fx.make_model("mixtral")
    model.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ConfigError, match="the act_fn of the experts of 'model.layers.1.mlp' matches none"):
        autoep.detect(model, load({"enabled": True}))
    model = fx.make_model("mixtral")
    model.model.layers[0].mlp.experts = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
    with pytest.raises(ConfigError, match=r"cannot split 'model.layers.0.mlp' \(MixtralSparseMoeBlock\): preset "
                                          r"'mixtral' matched it, but expert 0 has no weight 'gate_up_proj'"):
        autoep.detect(model, load({"enabled": True}))
    with pytest.raises(ConfigError, match="ambiguous"):
        autoep.detect(fx.make_model("olmoe"), load({"enabled": True}))
    cfg = fx.hf_config("mixtral")
    cfg.router_jitter_noise = 0.1
    with pytest.raises(ConfigError, match="router_jitter_noise=0.1, but AutoEP's router does not implement jitter"):
        autoep.detect(fx.model_class("mixtral")(cfg), load({"enabled": True}))


# -- the swapped layer on one process ----------------------------------------------------------------------


def _swap(model, section=None):
    from dslaunch.runtime.moe import autoep
    from dslaunch.runtime.moe.autoep.convert import swap

    cfg = load(dict({"enabled": True}, **(section or {})))
    swap(model, autoep.detect(model, cfg), cfg, 1, 0, None)
    return model


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# every family with the defaults; the other expert and combine forms on two of them
CASES = [(m, {}) for m in MODELS] + [(m, s) for m in ("mixtral", "deepseek_v3") for s in (
    {"use_grouped_mm": False}, {"gate_up_impl": "fused"}, {"combine_impl": "legacy_bmm"})]


@pytest.mark.parametrize("name,section", CASES, ids=[f"{m}-{'-'.join(s) or 'default'}" for m, s in CASES])
def test_swapped_model_computes_the_model_and_its_gradients(name, section):
    from dslaunch.runtime.moe import autoep

    ref = fx.make_model(name)
    model = _swap(copy.deepcopy(ref), dict(section, **({"preset_model": fx.PRESET[name]} if name in fx.PRESET else {})))
    assert autoep.autoep_layers(model)
    ids = torch.cat([fx.batch(0, 0), fx.batch(0, 1)])
    loss, grads = _loss_and_grads(model, ids)
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert torch.allclose(loss, ref_loss, atol=1e-6, rtol=0)
    # the expert gradients, in the model's own layout, through hf_state_dict's inverse
    back = autoep.hf_state_dict(_as_grads(model))
    for key, g in ref_grads.items():
        assert torch.allclose(back[key], g, atol=1e-6, rtol=0), key


def _as_grads(model):
    """The model with each parameter's value replaced by its gradient (hf_state_dict reads values)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    return model


@pytest.mark.parametrize("name", MODELS)
def test_hf_state_dict_is_the_models_own(name):
    from dslaunch.runtime.moe import autoep

    ref = fx.make_model(name)
    model = _swap(copy.deepcopy(ref), {"preset_model": fx.PRESET[name]} if name in fx.PRESET else {})
    want, got = ref.state_dict(), autoep.hf_state_dict(model)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def _list_model():
    """Mixtral with transformers 4.x's layout: a ModuleList of w1/w2/w3 expert MLPs."""
    hf = load_script("make_ds_hf_moe_fixtures")
    return hf.make_model("mixtral_list")[0]


def test_a_modulelist_of_experts_splits_with_the_expert_weight_names():
    from dslaunch.runtime.moe import autoep

    ref = _list_model()
    section = {"preset_model": "mixtral", "expert_w1": "w1", "expert_w2": "w2", "expert_w3": "w3"}
    model = _swap(copy.deepcopy(ref), section)
    ids = torch.cat([fx.batch(0, 0), fx.batch(0, 1)])
    assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-6, rtol=0)
    want, got = ref.state_dict(), autoep.hf_state_dict(model)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ConfigError, match="cannot split 'model.layers.0.mlp' .* expert 0 has no weight "
                                          "'gate_up_proj'"):
        _swap(copy.deepcopy(ref), {"preset_model": "mixtral"})


def test_a_client_optimizer_and_parameter_list_follow_the_swap():
    from dslaunch.runtime.moe import autoep

    model = fx.make_model("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    params = list(model.parameters())
    p = _plan_one(model)

    class Mesh:
        def group(self, axis):
            return None

        def rank(self, axis):
            return 0

    opt, params = autoep.attach(p, _config_one(), model, Mesh(), opt, params)
    live = {id(q) for q in model.parameters()}
    assert {id(q) for g in opt.param_groups for q in g["params"]} == live
    assert {id(q) for q in params} == live
    moe = [g for g in opt.param_groups if g.get("moe")]
    assert len(moe) == 1 and moe[0]["name"] == "ep_size_1" and moe[0]["lr"] == 0.1
    assert all(getattr(q, "allreduce", True) is False for q in moe[0]["params"])


def _config_one():
    return DeepSpeedConfig.load({"train_batch_size": 2, "expert_parallel": {"enabled": True, "autoep_size": 1}})


def _plan_one(model):
    from dslaunch.runtime.moe import autoep

    return autoep.plan(_config_one(), model, None, 1, False)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_bf16_swapped_model_computes_the_model_within_bf16_rounding(grouped):
    # bf16 rounds the routed copies' outputs at another point than the model's per-expert loop:
    # about 1e-4 on this loss (3 significant digits of 4.2), the bound 1e-2
    ref = fx.make_model("mixtral").to(torch.bfloat16)
    model = _swap(copy.deepcopy(ref), {"use_grouped_mm": grouped})
    ids = torch.cat([fx.batch(0, 0), fx.batch(0, 1)])
    assert abs(model(input_ids=ids, labels=ids).loss.item() - ref(input_ids=ids, labels=ids).loss.item()) < 1e-2
