"""The whole DeepSpeed config surface: every key DeepSpeed reads is declared (supported or
refused), every refused key is refused with its one-line reason and accepted at its off
value, "auto" names its key, typos still get "did you mean", and the key table in
docs/configuration.md is the generated one. Pure logic, no processes."""

import pytest

from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.config import table
from dslaunch.runtime.config.zero import ZeroConfig
from dslaunch.runtime.strict import ConfigError, key_rows
import repo_paths

ROOT = repo_paths.ROOT
ROWS = list(key_rows(DeepSpeedConfig))
DECLARED = {r.key for r in ROWS}
REFUSED = [r for r in ROWS if r.status.startswith("refused")]
# Sections refused as a whole: DeepSpeed's sub-keys of these need no declaration of their own.
WHOLE = {r.key for r in REFUSED}


REQUIRED = {"optimizer": {"type": "Adam"}, "scheduler": {"type": "WarmupLR"}}


def _nest(key: str, value):
    """{"a": {"b": value}} for "a.b", with the sections' required keys filled in."""
    parts = key.split(".")
    out = value
    for depth in range(len(parts) - 1, -1, -1):
        inner = out if depth == len(parts) - 1 else {**REQUIRED.get(parts[depth], {}), **out}
        out = {parts[depth]: inner}
    return out


def _refusing_value(info):
    from dslaunch.runtime.strict import _same

    for candidate in (True, False, 7, 0.5, "x", {"enabled": True}, ["x"]):
        if not any(_same(candidate, ok) for ok in info.accepted):
            return candidate
    raise AssertionError("no value refuses this key")


def _info(key: str):
    from dslaunch.runtime.strict import key_info

    return key_info(_declared_field(key))


def _declared_field(key: str):
    import dataclasses
    import typing

    from dslaunch.runtime.strict import _sections

    cls = DeepSpeedConfig
    parts = key.split(".")
    for part in parts[:-1]:
        hints = typing.get_type_hints(cls, vars(__import__(cls.__module__, fromlist=["x"])))
        cls = _sections(hints[part])[0]
    name = getattr(cls, "ALIASES", {}).get(parts[-1], parts[-1])  # another spelling: its target's declaration
    return {f.name: f for f in dataclasses.fields(cls)}[name]


def test_every_deepspeed_key_is_declared():
    listed = [line.strip() for line in (ROOT / "tests/data/deepspeed_config_keys.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert len(listed) > 200
    missing = [k for k in listed if k not in DECLARED and not any(k.startswith(w + ".") for w in WHOLE)]
    assert missing == []


@pytest.mark.parametrize("row", REFUSED, ids=[r.key for r in REFUSED])
def test_refused_key_message(row):
    info = _info(row.key)
    value = _refusing_value(info)
    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.load(_nest(row.key, value))
    assert str(err.value) == f"config: {row.key}: {info.refused}"
    assert "\n" not in info.refused and (info.refused == row.note or row.note.startswith("another spelling"))
    for ok in info.accepted:  # the off values load and ask for nothing
        if not callable(ok):
            DeepSpeedConfig.load(_nest(row.key, ok))


def test_headline_refusals_read_well():
    cases = {
        "zero_optimization.mics_shard_size": (8, "MiCS sharding is not supported (DeepSpeed removed it too); "
                                                 "remove it"),
        "hybrid_engine": ({"enabled": True}, "the RLHF hybrid engine is not supported; remove it"),
    }
    for key, (value, reason) in cases.items():
        with pytest.raises(ConfigError) as err:
            DeepSpeedConfig.load(_nest(key, value))
        assert str(err.value) == f"config: {key}: {reason}"
    DeepSpeedConfig.load({"zero_optimization": {"mics_shard_size": -1, "zeropp_loco_param": None},
                          "hybrid_engine": {"enabled": False, "max_out_tokens": 512}})


@pytest.mark.parametrize("raw,key", [
    ({"train_batch_size": "auto"}, "train_batch_size"),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": ["auto", 0.9]}}}, "optimizer.params.betas[0]"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}}, "zero_optimization.stage3_prefetch_bucket_size"),
    ({"zero_optimization": {"zero_hpz_partition_size": "auto"}}, "zero_optimization.zero_hpz_partition_size"),
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
])
def test_auto_names_its_key(raw, key):
    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.load(raw)
    assert str(err.value) == (f'config: {key}: "auto" is a placeholder the caller must resolve (the Hugging Face '
                              f'Trainer and Accelerate fill it in before calling initialize); write the actual value')


@pytest.mark.parametrize("raw,message", [
    ({"zero_optimization": {"zero_hpz_partiton_size": 1}},
     "config: zero_optimization.zero_hpz_partiton_size: unknown key; did you mean 'zero_hpz_partition_size'?"),
    ({"flops_profiler": {"profile_stepp": 3}}, "config: flops_profiler.profile_stepp: unknown key; did you mean "
                                                "'profile_step'?"),
    ({"tensorbord": {"enabled": True}}, "config: tensorbord: unknown key; did you mean 'tensorboard'?"),
    # DeepSpeed's test_fp16 writes torch_adam beside params, where DeepSpeed never reads it
    ({"optimizer": {"type": "Adam", "torch_adam": True, "params": {"lr": 1e-3}}},
     "config: optimizer.torch_adam: unknown key; optimizer arguments belong in optimizer.params (DeepSpeed "
     "ignores keys beside it): move it there"),
])
def test_typos_still_get_did_you_mean(raw, message):
    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.load(raw)
    assert str(err.value) == message


def test_deepspeed_spellings_without_stage3_prefix():
    cfg = DeepSpeedConfig.load({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 123,
                                                      "param_persistence_threshold": 7}})
    z = cfg.zero_optimization
    assert z.stage3_prefetch_bucket_size == 123 and z.stage3_param_persistence_threshold == 7


def test_deepspeed_zero_config_takes_deepspeeds_spellings_and_attribute_names():
    """deepspeed.runtime.zero.config.DeepSpeedZeroConfig(**section), as DeepSpeed's model: the
    stage3_ prefix or not, and the deprecated fp16 name, all read back under DeepSpeed's
    attribute gather_16bit_weights_on_model_save; parsed strictly."""
    from dslaunch.runtime.zero.config import DeepSpeedZeroConfig

    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        cfg = DeepSpeedZeroConfig(**{key: True})
        assert cfg.gather_16bit_weights_on_model_save is True
        assert isinstance(cfg, ZeroConfig) and isinstance(cfg, DeepSpeedZeroConfig)
    assert DeepSpeedZeroConfig().gather_16bit_weights_on_model_save is False
    assert DeepSpeedZeroConfig(stage=2, reduce_bucket_size=100).reduce_bucket_size == 100
    # DeepSpeed's field names are the unprefixed ones (its test_zero_config_aliasfields)
    for name in ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                 "max_reuse_distance", "module_granularity_threshold"):
        cfg = DeepSpeedZeroConfig(**{"stage3_" + name: 12345})
        assert getattr(cfg, name) == 12345 == getattr(cfg, "stage3_" + name), name
        setattr(cfg, name, 7)
        assert getattr(cfg, "stage3_" + name) == 7, name
    assert DeepSpeedZeroConfig().prefetch_bucket_size == 50_000_000
    from dslaunch.runtime.core.config.zero import DeepSpeedZeroOffloadOptimizerConfig

    for read, write in ((False, False), (True, False), (False, True), (True, True)):
        assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=read, pipeline_write=write).pipeline is (read or write)
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: must be 0, 1, 2 or 3, got 7"):
        DeepSpeedZeroConfig(stage=7)


def test_overlap_comm_reads_as_deepspeeds_default_and_overlaps_unless_false():
    """Not given, overlap_comm reads as DeepSpeed's resolved default (true at stage 3 only), and
    the reduces still overlap backward at every stage; an explicit false is obeyed."""
    from dslaunch.runtime.zero.config import DeepSpeedZeroConfig

    for stage in (0, 1, 2, 3):
        cfg = DeepSpeedZeroConfig(stage=stage)
        assert cfg.overlap_comm is (stage == 3) and cfg.overlaps_reduction, stage
        for given in (True, False):
            cfg = DeepSpeedZeroConfig(stage=stage, overlap_comm=given)
            assert cfg.overlap_comm is given and cfg.overlaps_reduction is given, (stage, given)
    z = DeepSpeedConfig.load({"train_batch_size": 1, "zero_optimization": {"stage": 1}}).zero_optimization
    assert z.overlap_comm is False and z.overlaps_reduction


def test_deprecated_cpu_offload_maps_like_deepspeed():
    z = DeepSpeedConfig.load({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                    "cpu_offload_use_pin_memory": True}}).zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "cpu"
    assert z.offload_optimizer.pin_memory and z.offload_param.pin_memory


def test_docs_table_is_generated():
    text = (ROOT / table.DOC).read_text()
    assert table.doc_block(text) == table.markdown(), \
        f"the key table in {table.DOC} is stale: run python -m dslaunch.runtime.config.table --write"


def test_zero3_check_key_and_env_override(monkeypatch):
    z = DeepSpeedConfig.load({"zero_optimization": {"stage": 3, "enable_sanity_checks": True}}).zero_optimization
    monkeypatch.delenv("DSLAUNCH_ZERO3_CHECK", raising=False)
    assert z.sanity_checks() is True
    monkeypatch.setenv("DSLAUNCH_ZERO3_CHECK", "0")
    assert z.sanity_checks() is False
    monkeypatch.setenv("DSLAUNCH_ZERO3_CHECK", "1")
    assert DeepSpeedConfig.load({}).zero_optimization.sanity_checks() is True
