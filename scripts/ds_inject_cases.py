"""The calls of DeepSpeed's deepspeed.module_inject.tp_shard and
deepspeed.moe.fused_expert_layout that tests/runtime/tensor_parallel/test_module_inject_ds.py compares: recorded from
DeepSpeed by scripts/make_ds_inject_fixtures.py (tests/data/ds_inject.json)."""

# (total_size, tp, meta kwargs, layer name): head splits, MLP / vocabulary names that never
# split by heads, grains with a tail, dimensions smaller than a grain
SHARD_CASES = [
    (384, 4, {"num_kv_heads": 6}, "layers.0.self_attn.q_proj"),
    (384, 4, {"num_kv_heads": 6}, "layers.0.mlp.up_proj"),
    (384, 4, {"num_kv_heads": 6}, "lm_head"),
    (384, 4, {"num_kv_heads": 6}, "model.layers.0.block_sparse_moe.experts.0.w1"),
    (384, 4, {"num_kv_heads": 5}, "layers.0.self_attn.q_proj"),
    (96, 3, {"num_kv_heads": 8}, "attn.k_proj"),
    (50257, 2, {"tp_grain_size": 64}, "lm_head"),
    (50257, 8, {"tp_grain_size": 64}, "lm_head"),
    (151936, 8, {"tp_grain_size": 64}, "embed_out"),
    (32000, 4, {"tp_grain_size": 64}, None),
    (101, 2, {}, "lm_head"),
    (7, 4, {}, None),
    (40, 3, {"tp_grain_size": 64}, "o_proj"),
    (130, 3, {"tp_grain_size": 32, "num_kv_heads": 4}, "self_attn.o_proj"),
]

# (w1 shape, w2 shape)
LAYOUT_CASES = [
    ((8, 256, 64), (8, 64, 128)),
    ((8, 64, 256), (8, 128, 64)),
    ((8, 64, 64), (8, 64, 64)),
    ((8, 255, 64), (8, 64, 127)),
    ((64, 64), (64, 64)),
    ((4, 32, 32), (4, 16, 32)),
    ((4, 32, 32), (4, 32, 16)),
    ((2, 6, 4), (2, 4, 3, 1)),
]


def config_cases():
    """Model configs for AutoTPMeta.from_model_config (plain objects with the attributes)."""
    from types import SimpleNamespace as N
    return {
        "llama_gqa": N(num_key_value_heads=2, num_attention_heads=8, hidden_size=64),
        "falcon": N(num_kv_heads=1, num_attention_heads=4, hidden_size=32),
        "gpt2": N(n_head=4, n_embd=48),
        "plain": N(num_attention_heads=6, hidden_size=96),
        "multimodal": N(num_attention_heads=16, text_config=N(num_key_value_heads=4, num_attention_heads=8,
                                                             hidden_size=128)),
        "none_kv": N(num_key_value_heads=None, num_attention_heads=4, hidden_size=16),
    }


def plan_models():
    """Objects shaped like Hugging Face models for _get_hf_tp_plan: plans on the config, the
    class and the instance, `model.`-prefixed duplicates, empty and missing plans."""
    from types import SimpleNamespace as N

    class WithClassPlan:
        _tp_plan = {"lm_head": "colwise_gather_output", "model.layers.*.mlp.up_proj": "colwise"}

    def instance(cls, **attrs):
        obj = cls()
        obj.__dict__.update(attrs)
        return obj

    class Plain:
        pass

    base = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.up_proj": "colwise"}
    return {
        "config_only": instance(Plain, config=N(base_model_tp_plan=dict(base))),
        "class_and_config": instance(WithClassPlan, config=N(base_model_tp_plan=dict(base))),
        "instance_overrides": instance(WithClassPlan, config=N(base_model_tp_plan=dict(base)),
                                       _tp_plan={"lm_head": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}),
        "empty": instance(Plain, _tp_plan={}),
        "none_plan_config": instance(Plain, _tp_plan=None, config=N(base_model_tp_plan={"a.*.b": "rowwise"})),
        "nothing": instance(Plain),
    }


# Hugging Face tp plans for TPPlanConverter.convert (the last two are rejected whole)
HF_PLANS = [
    {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"},
    {"lm_head": "colwise_gather_output", "legacy_lm_head": "colwise_rep", "model.embed_tokens": "embedding_rowwise",
     "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce", "layers.*.mlp.up_proj.weight": "COLWISE"},
    {},
    {"layers.*.q_proj": "local_colwise", "layers.*.o_proj": "rowwise"},
    {"layers.*.experts": "moe_tp_experts", "layers.*.q_proj": "sequence_parallel"},
]

# partition_config dicts for AutoTPConfig.from_dict, then the names find_matching_spec is asked
SPEC_DICTS = [
    {"layer_specs": [{"patterns": [r".*\.lm_head\.weight$"], "partition_type": "column", "gather_output": True}]},
    {"tp_size": 4, "strict_mode": True, "lm_head_patterns": ["out"],
     "layer_specs": [{"patterns": [r".*\.qkv\.weight$"], "partition_type": "COLUMN", "shape": [[64, 16, 16], -1]},
                     {"patterns": [r".*\.o_proj\.weight$", r".*\.qkv\.weight$"], "partition_type": "row",
                      "model_types": ["Llama"]},
                     {"patterns": [r".*\.experts\.w1$"], "partition_type": "column", "shape": [8, -1, 32],
                      "partition_dim": 1},
                     {"patterns": [r".*\.gate$"], "partition_type": "skip", "grad_allreduce": True}]},
]
MATCH_NAMES = [("model.layers.0.qkv.weight", None), ("model.layers.0.qkv.weight", "llama"),
               ("model.layers.0.o_proj.weight", "LLAMA"), ("model.layers.0.o_proj.weight", "gpt2"),
               ("model.layers.1.mlp.gate", None), ("x.lm_head.weight", None), ("nothing", None)]

# TPLayerSpec(shape=..., partition_type=..., partition_dim=...) that DeepSpeed refuses or takes
SHAPE_CASES = [
    ((3, -1), "column", None), (((4096, 1024, 1024), -1), "column", None), ((8, -1, 32), "column", 1),
    ((-1, (2, 2)), "row", None), (((2, 2), -1), "row", None), ((0, -1), "column", None), ((-2, 4), "column", None),
    ((3, -1), "column", 2), ((((1, 2),), -1), "column", None), (((), -1), "column", None),
    (((2, 0), -1), "column", None), ((2.5, -1), "column", None), (([4, 4], -1), "column", None),
    ([[[1, 2]], -1], "column", None), ([[2, 2], -1], "column", None),
]
