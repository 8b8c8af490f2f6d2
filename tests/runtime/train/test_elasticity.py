"""deepspeed.elasticity.compute_elastic_config on DeepSpeed's documented examples (its
unit tests' config: max batch 10000, micro batches 8/12/16/17, 32-1500 GPUs), and the
engine taking its batch sizes from the elasticity section."""
import pytest

import dslaunch.runtime as deepspeed
from dslaunch.runtime.config import DeepSpeedConfig, resolve_batch_sizes
from dslaunch.runtime.elasticity import (ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize,
                                         compute_elastic_config, highly_composite_numbers)

V = "0.19.8"


@pytest.fixture
def ds_config():
    return {"elasticity": {"enabled": True, "max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17],
                           "min_gpus": 32, "max_gpus": 1500, "min_time": 20, "version": 0.1}}


def test_highly_composite_numbers():
    h = highly_composite_numbers()
    assert h[:14] == (1, 2, 4, 6, 12, 24, 36, 48, 60, 120, 180, 240, 360, 720) and h[-1] == 720720 and len(h) == 38


def test_basic_10k(ds_config):
    batch, gpus = compute_elastic_config(ds_config, target_deepspeed_version=V)
    assert batch == 9792 and len(gpus) == 23
    for n in gpus:
        assert batch % n == 0 and any((batch // n) % mb == 0 for mb in [8, 12, 16, 17])


def test_world_size_gives_the_micro_batch(ds_config, monkeypatch):
    assert compute_elastic_config(ds_config, V, world_size=64)[2] == 17
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(ds_config, V, world_size=128)
    monkeypatch.setenv("WORLD_SIZE", "64")
    batch, gpus = compute_elastic_config(ds_config, V)
    assert compute_elastic_config(ds_config, V, return_microbatch=True) == (batch, gpus, 17)
    monkeypatch.setenv("WORLD_SIZE", "128")
    with pytest.raises(ElasticityIncompatibleWorldSize):
        compute_elastic_config(ds_config, V, return_microbatch=True)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ElasticityConfigError):
        compute_elastic_config(ds_config, V, return_microbatch=True)


@pytest.mark.parametrize("change", [
    {"enabled": False}, {"version": "0.3"}, {"version": 0.3}, {"max_train_batch_size": None},
    {"micro_batch_sizes": None}, {"micro_batch_sizes": [1, 4, -1, 2, -10]}, {"min_gpus": -1}, {"max_gpus": -1},
    {"micro_batch_sizes": 5}, {"micro_batch_sizes": ["a", None, 0.5]}, {"micro_batch_sizes": [2, 0.5, 4]},
    {"model_parallel_size": 4, "num_gpus_per_node": 8, "version": 0.1},
])
def test_bad_configs_are_elasticity_errors(ds_config, change):
    for key, value in change.items():
        if value is None:
            ds_config["elasticity"].pop(key)
        else:
            ds_config["elasticity"][key] = value
    with pytest.raises(ElasticityError):
        compute_elastic_config(ds_config, V)


def test_old_target_version_and_empty_section(ds_config):
    with pytest.raises(ElasticityError):
        compute_elastic_config(ds_config, target_deepspeed_version="0.2")
    with pytest.raises(ElasticityError):
        compute_elastic_config({"elasticity": {"enabled": True}}, V)


def test_version_02_model_parallel(ds_config, monkeypatch):
    ds_config["elasticity"].update(model_parallel_size=16, num_gpus_per_node=8, version=0.2)
    with pytest.raises(ElasticityError):
        compute_elastic_config(ds_config, V, world_size=16)
    ds_config["elasticity"].update(model_parallel_size=4)
    monkeypatch.setenv("WORLD_SIZE", "16")
    compute_elastic_config(ds_config, V)


@pytest.mark.parametrize("mp,micro,expected", [(1, [4, 8], 4), (2, [4, 8], 8), (4, [4, 8], 8), (2, [8], 8),
                                               (4, [8], 8)])
def test_version_02_micro_batch_is_per_data_parallel_rank(ds_config, monkeypatch, mp, micro, expected):
    ds_config["elasticity"].update(version=0.2, model_parallel_size=mp, num_gpus_per_node=8,
                                   max_train_batch_size=64, micro_batch_sizes=micro, min_gpus=16, max_gpus=16)
    monkeypatch.setenv("WORLD_SIZE", "16")
    batch, _, mb = compute_elastic_config(ds_config, V, return_microbatch=True)
    assert mb == expected and batch // (16 // mp) % mb == 0


def test_proper_micro_batch_and_cap(ds_config):
    ds_config["elasticity"].update(max_train_batch_size=32, micro_batch_sizes=[1, 2, 3, 7], min_gpus=1)
    assert compute_elastic_config(ds_config, V, world_size=4)[2] == 3
    ds_config["elasticity"].update(max_train_batch_size=100, micro_batch_sizes=[8, 10, 12])
    assert compute_elastic_config(ds_config, V)[0] <= 100


def test_engine_batch_sizes_come_from_the_section(monkeypatch):
    section = {"enabled": True, "max_train_batch_size": 4, "micro_batch_sizes": [1, 2, 3, 4], "min_gpus": 1,
               "max_gpus": 4, "min_time": 20, "version": 0.1}
    cfg = DeepSpeedConfig.load({"elasticity": section})
    b = resolve_batch_sizes(cfg, 2)
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (4, 2, 1)
    with pytest.raises(ElasticityConfigError, match="train_batch_size would be overridden by the elastic batch"):
        resolve_batch_sizes(DeepSpeedConfig.load({"train_batch_size": 2, "elasticity": section}), 2)
    ok = DeepSpeedConfig.load({"train_batch_size": 2, "elasticity": {**section, "ignore_non_elastic_batch_info": True}})
    assert resolve_batch_sizes(ok, 2).train_batch_size == 4
    monkeypatch.setenv("DEEPSPEED_ELASTICITY_CONFIG", '{"elasticity": ' + str({**section, "max_train_batch_size": 27})
                       .replace("'", '"').replace("True", "true") + "}")
    with pytest.raises(ElasticityConfigError, match="resource scheduler"):
        resolve_batch_sizes(cfg, 2)
    assert deepspeed.elasticity.compute_elastic_config is compute_elastic_config
