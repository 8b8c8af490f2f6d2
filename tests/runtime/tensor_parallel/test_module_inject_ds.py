"""deepspeed.module_inject.tp_shard, deepspeed.moe.fused_expert_layout and
deepspeed.runtime.tensor_parallel.config._get_hf_tp_plan against DeepSpeed 0.19.8's answers
recorded in tests/data/ds_inject.json (scripts/make_ds_inject_fixtures.py; the cases are
scripts/ds_inject_cases.py). DeepSpeed's paths are reached the way the compatibility package
reaches them: deepspeed.X is dslaunch.runtime.X."""
import dataclasses
import importlib
import json
import sys

import pytest

import dslaunch.runtime  # noqa: F401  installs the alias table

from repo_paths import DATA, SCRIPTS  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
from ds_inject_cases import (HF_PLANS, LAYOUT_CASES, MATCH_NAMES, SHAPE_CASES, SHARD_CASES, SPEC_DICTS,  # noqa: E402
                             config_cases, plan_models)

DS = json.loads((DATA / "ds_inject.json").read_text())
tp_shard = importlib.import_module("dslaunch.runtime.module_inject.tp_shard")


@pytest.fixture(autouse=True)
def restore_settings():
    saved = tp_shard.num_kv_heads, tp_shard.tp_grain_size
    yield
    tp_shard.set_num_kv_heads(saved[0])
    tp_shard.set_tp_grain_size(saved[1])


def test_recorded_from_deepspeed_0_19_8():
    assert DS["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("i", range(len(SHARD_CASES)))
def test_shard_sizes_with_meta_equal_deepspeeds(i):
    total, tp, meta, name = SHARD_CASES[i]
    m = tp_shard.AutoTPMeta(**meta)
    assert tp_shard.get_shard_size_list(total, tp, m, name) == DS["shards"][i]["list"]
    assert [tp_shard.get_shard_size(total, tp, m, name, r) for r in range(tp)] == DS["shards"][i]["each"]
    assert [tp_shard.get_shard_size(total, tp, meta=m, name=name, rank=r) for r in range(tp)] == DS["shards"][i]["each"]


@pytest.mark.parametrize("i", range(len(SHARD_CASES)))
def test_module_settings_convention_gives_the_same_sizes(i):
    # the earlier convention: head count and grain set on the module, the name third
    total, tp, meta, name = SHARD_CASES[i]
    tp_shard.set_num_kv_heads(meta.get("num_kv_heads"))
    tp_shard.set_tp_grain_size(meta.get("tp_grain_size", 1))
    assert tp_shard.get_shard_size_list(total, tp, name) == DS["shards"][i]["list"]
    assert [tp_shard.get_shard_size(total, tp, name, r) for r in range(tp)] == DS["shards"][i]["each"]
    if meta.get("num_kv_heads") is not None:  # an explicit num_kv_heads wins over the module's
        tp_shard.set_num_kv_heads(None)
        assert tp_shard.get_shard_size_list(total, tp, name, num_kv_heads=meta["num_kv_heads"]) == \
            DS["shards"][i]["list"]


def test_rank_from_the_group_or_a_refusal(monkeypatch):
    m = tp_shard.AutoTPMeta(tp_grain_size=64)
    group = object()
    monkeypatch.setattr(tp_shard.dist, "get_rank", lambda group=None: 1 if group is not None else 5)
    assert tp_shard.get_shard_size(50257, 2, m, "lm_head", mp_group=group) == \
        tp_shard.get_shard_size_list(50257, 2, m, "lm_head")[1]
    monkeypatch.setattr(tp_shard.dist, "get_world_size", lambda group=None: 4)
    with pytest.raises(ValueError, match="group-local rank or process group when mp_size \\(2\\)"):
        tp_shard.get_shard_size(12, 2, m)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_kv_heads'"):
        tp_shard.get_shard_size(12, 2, m, num_kv_heads=2)


@pytest.mark.parametrize("name", sorted(config_cases()))
def test_meta_from_model_config_equals_deepspeeds(name):
    got = tp_shard.AutoTPMeta.from_model_config(config_cases()[name], tp_grain_size=8)
    assert dataclasses.asdict(got) == DS["metas"][name]
    assert dataclasses.asdict(tp_shard.AutoTPMeta.from_model_config(None)) == DS["metas"]["none"]


def test_module_inject_is_a_package_with_tp_shard_and_the_mode_switch():
    inject = importlib.import_module("dslaunch.runtime.module_inject")
    assert inject.tp_shard is tp_shard
    from dslaunch.runtime.tensor_parallel import mode
    assert inject.set_autotp_mode is mode.set_autotp_mode


@pytest.mark.parametrize("i", range(len(LAYOUT_CASES)))
def test_fused_expert_layout_equals_deepspeeds(i):
    layout = importlib.import_module("dslaunch.runtime.moe.fused_expert_layout")
    found = layout.classify_fused_gate_up_layout(*LAYOUT_CASES[i])
    assert (None if found is None else dataclasses.asdict(found)) == DS["layouts"][i]


@pytest.mark.parametrize("name", sorted(plan_models()))
def test_hf_tp_plan_equals_deepspeeds(name):
    config = importlib.import_module("dslaunch.runtime.tensor_parallel.config")
    got = config._get_hf_tp_plan(plan_models()[name])
    assert got == DS["plans"][name]
    if got is not None:  # and in DeepSpeed's order
        assert list(got) == list(DS["plans"][name])


autotp_config = importlib.import_module("dslaunch.runtime.module_inject.autotp_config")
TPPlanConverter = importlib.import_module("dslaunch.runtime.module_inject.tp_plan_converter").TPPlanConverter


def _spec(s):  # as scripts/make_ds_inject_fixtures.py records one (JSON: tuples as lists)
    return json.loads(json.dumps({
        "patterns": list(s.patterns), "partition_type": s.partition_type.value, "shape": s.shape,
        "partition_dim": s.partition_dim, "model_types": s.model_types, "gather_output": s.gather_output,
        "grad_allreduce": s.grad_allreduce, "dim": s.get_partition_dim(), "unequal": s.has_unequal_sub_params(),
        "sizes": s.get_sub_param_sizes(), "count": s.get_num_sub_params()}))


def _config(c):
    return {"tp_size": c.tp_size, "layer_specs": [_spec(s) for s in c.layer_specs],
            "embedding_partition_dim": c.embedding_partition_dim, "lm_head_patterns": c.lm_head_patterns,
            "use_default_specs": c.use_default_specs, "strict_mode": c.strict_mode}


@pytest.mark.parametrize("i", range(len(HF_PLANS)))
def test_tp_plan_converter_equals_deepspeeds(i):
    want = DS["converted"][i]
    if isinstance(want, dict):
        with pytest.raises(ValueError) as err:
            TPPlanConverter.convert(HF_PLANS[i])
        assert str(err.value) == want["error"]
        return
    got = TPPlanConverter.convert(HF_PLANS[i])
    assert (None if got is None else [_spec(s) for s in got]) == want


@pytest.mark.parametrize("i", range(len(SPEC_DICTS)))
def test_autotp_config_from_dict_and_matching_equal_deepspeeds(i):
    c = autotp_config.AutoTPConfig.from_dict(SPEC_DICTS[i])
    assert _config(c) == DS["configs"][i]["config"]
    found = [c.find_matching_spec(n, t) for n, t in MATCH_NAMES]
    assert [None if f is None else c.layer_specs.index(f) for f in found] == DS["configs"][i]["matches"]


def test_merge_autotp_configs_equals_deepspeeds():
    merged = autotp_config.merge_autotp_configs(autotp_config.AutoTPConfig.from_dict(SPEC_DICTS[1]),
                                                autotp_config.AutoTPConfig.from_dict(SPEC_DICTS[0]))
    assert _config(merged) == DS["merged"]


@pytest.mark.parametrize("i", range(len(SHAPE_CASES)))
def test_layer_spec_shapes_equal_deepspeeds(i):
    shape, ptype, dim = SHAPE_CASES[i]
    want = DS["shapes"][i]
    if "error" in want:
        with pytest.raises(ValueError) as err:
            autotp_config.TPLayerSpec(patterns=["x"], partition_type=ptype, shape=shape, partition_dim=dim)
        assert str(err.value) == want["error"]
    else:
        assert _spec(autotp_config.TPLayerSpec(patterns=["x"], partition_type=ptype, shape=shape,
                                               partition_dim=dim)) == want


def test_module_inject_exports_the_spec_objects():
    inject = importlib.import_module("dslaunch.runtime.module_inject")
    assert inject.AutoTPConfig is autotp_config.AutoTPConfig and inject.TPLayerSpec is autotp_config.TPLayerSpec
    assert inject.PartitionType.ROW.value == "row"
