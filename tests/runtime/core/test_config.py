"""The config schema: batch-size table, bad-config table with exact messages, JSON/YAML
errors with positions, and the seeds' configs loading unchanged. Pure logic, no processes."""
import json
import os

import pytest

from dslaunch.runtime.config import BatchSizes, DeepSpeedConfig, resolve_batch_sizes
from dslaunch.runtime.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler
from dslaunch.runtime.optim import build_optimizer
from dslaunch.runtime.strategy import strategy_for_stage
from dslaunch.runtime.strict import ConfigError

RULE = "; the rule is train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size"

BATCH_TABLE = [
    # (train_batch_size, micro, gas, world) -> BatchSizes or error message
    ((64, None, None, 8), BatchSizes(64, 8, 1)),
    ((64, 4, None, 2), BatchSizes(64, 4, 8)),
    ((64, None, 4, 2), BatchSizes(64, 8, 4)),
    ((None, 4, None, 2), BatchSizes(8, 4, 1)),
    ((None, 4, 3, 2), BatchSizes(24, 4, 3)),
    ((32, 4, 4, 2), BatchSizes(32, 4, 4)),
    ((64, 8, 2, 2), "batch size: train_batch_size 64 != 8 x 2 x 2 = 32 (train_micro_batch_size_per_gpu 8, "
                    "gradient_accumulation_steps 2, data-parallel size 2 (WORLD_SIZE from the launcher environment))" + RULE),
    ((10, 4, None, 2), "batch size: train_batch_size 10 is not divisible by train_micro_batch_size_per_gpu 4 x "
                       "data-parallel size 2 (WORLD_SIZE from the launcher environment)" + RULE),
    ((6, None, 4, 1), "batch size: train_batch_size 6 is not divisible by gradient_accumulation_steps 4 x "
                      "data-parallel size 1 (WORLD_SIZE from the launcher environment)" + RULE),
    ((3, None, None, 2), "batch size: train_batch_size 3 is not divisible by data-parallel size 2 "
                         "(WORLD_SIZE from the launcher environment)" + RULE),
    ((None, None, 2, 2), "batch size: set train_batch_size or train_micro_batch_size_per_gpu "
                         "(neither is in the config)" + RULE),
]


@pytest.mark.parametrize("given,expected", BATCH_TABLE)
def test_batch_size_table(given, expected):
    tb, mb, gas, world = given
    raw = {k: v for k, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                             ("gradient_accumulation_steps", gas)) if v is not None}
    cfg = DeepSpeedConfig.load(raw)
    if isinstance(expected, BatchSizes):
        assert resolve_batch_sizes(cfg, world, "WORLD_SIZE from the launcher environment") == expected
    else:
        with pytest.raises(ConfigError) as info:
            resolve_batch_sizes(cfg, world, "WORLD_SIZE from the launcher environment")
        assert str(info.value) == expected


BAD_CONFIGS = [
    ({"train_batch_sise": 8}, "config: train_batch_sise: unknown key; did you mean 'train_batch_size'?"),
    ({"zero_optimization": {"stgae": 2}}, "config: zero_optimization.stgae: unknown key; did you mean 'stage'?"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "config: zero_optimization.offload_optimizer.device: \"gpu\" is not one of 'none', 'cpu', 'nvme'; "
     "did you mean 'cpu'?"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     "config: zero_optimization.offload_param.nvme_path: required when device is \"nvme\""),
    ({"zero_optimization": {"stage": 4}}, "config: zero_optimization.stage: must be 0, 1, 2 or 3, got 4"),
    ({"fp16": {"enabled": "yes"}}, "config: fp16.enabled: expected bool, got \"yes\""),
    ({"zero_allow_untested_optimizer": 2}, "config: zero_allow_untested_optimizer: expected bool, got 2"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "config: fp16.enabled and bf16.enabled: choose one of fp16 and bf16"),
    ({"train_batch_size": 8.5}, "config: train_batch_size: expected int, got 8.5"),
    ({"train_batch_size": 0}, "config: train_batch_size: must be > 0, got 0"),
    ({"gradient_clipping": "1.0"}, "config: gradient_clipping: expected float, got \"1.0\""),
    ({"optimizer": {"type": "Adam", "parms": {}}}, "config: optimizer.parms: unknown key; did you mean 'params'?"),
    ({"steps_per_print": True}, "config: steps_per_print: expected float, got true"),
    ({"steps_per_print": 2.5}, "config: steps_per_print: must be a whole number of steps (or Infinity for never), got 2.5"),
    ({"amp": {"enabled": True}},
     "config: amp: NVIDIA Apex amp is not supported (DeepSpeed removed it too); use \"fp16\" or \"bf16\""),
    ({"zero_optimization": "yes"}, "config: zero_optimization: expected object, got \"yes\""),
]


@pytest.mark.parametrize("raw,message", BAD_CONFIGS)
def test_bad_config_table(raw, message):
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig.load(raw)
    assert str(info.value) == message


def test_a_switch_written_as_0_or_1_is_taken_as_deepspeed_takes_it():
    """DeepSpeed's tests write "zero_allow_untested_optimizer": 1; pydantic's bool and its
    truthiness reads take 0 and 1, so they are switches here too (and nothing else is)."""
    on = DeepSpeedConfig.load({"train_batch_size": 1, "zero_allow_untested_optimizer": 1,
                               "bf16": {"enabled": 1}, "dataloader_drop_last": 0})
    assert on.zero_allow_untested_optimizer is True and on.bf16.enabled is True
    assert on.dataloader_drop_last is False


def test_json_syntax_error_has_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig.load(str(path))
    assert str(info.value).startswith(f"{path}:3:")
    assert "invalid JSON" in str(info.value)


def test_unknown_key_in_file_names_the_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "fp16": {"enabeld": True}}))
    with pytest.raises(ConfigError, match=r"ds.json: fp16.enabeld: unknown key; did you mean 'enabled'\?"):
        DeepSpeedConfig.load(str(path))


def test_yaml_config_and_missing_file(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_batch_size: 8\nzero_optimization:\n  stage: 1\n")
    assert DeepSpeedConfig.load(str(path)).zero_optimization.stage == 1
    with pytest.raises(ConfigError, match="cannot read config"):
        DeepSpeedConfig.load(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("kind,message", [
    ("/dev/zero", "/dev/zero: config file is a character device, not a regular file; refusing to read it"),
    ("fifo", "ds.json: config file is a FIFO, not a regular file; refusing to read it"),
    ("directory", "ds.json: config file is a directory, not a regular file; refusing to read it"),
    ("huge", "ds.json: config file is 67108865 bytes, over its limit of 64 MiB; refusing to read it"),
    ("latin-1", "ds.json: config is not UTF-8 text (invalid continuation byte at byte 25)"),
])
@pytest.mark.timeout(60)
def test_a_config_file_is_read_bounded_and_only_if_regular(tmp_path, kind, message):
    """/dev/zero grew the reader to 21.5 GB; a FIFO hung it: one line naming the file instead."""
    path = tmp_path / "ds.json"
    if kind == "fifo":
        os.mkfifo(path)  # nobody writes to it
    elif kind == "directory":
        path.mkdir()
    elif kind == "huge":
        with open(path, "wb") as fh:
            fh.truncate((64 << 20) + 1)
    elif kind == "latin-1":
        path.write_bytes(b'{"train_batch_size": 8, "\xe9": 1}')
    source = kind if kind == "/dev/zero" else str(path)
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig.load(source)
    assert str(info.value).endswith(message) and "\n" not in str(info.value)


@pytest.mark.timeout(120)
def test_initialize_with_dev_zero_as_config_is_one_line():
    import torch

    import dslaunch.runtime as deepspeed

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="^/dev/zero: config file is a character device, not a regular file"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config="/dev/zero")


def test_seed_configs_load_unchanged():
    # The GPT-lite post (with its "all_reduce_bucket_size" spelling), a ZeRO-2 offload
    # config, and the getting-started legacy boolean zero_optimization.
    gptlite = {"train_batch_size": 64, "steps_per_print": 100,
               "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                        "weight_decay": 3e-7}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                            "warmup_num_steps": 1000}},
               "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "all_reduce_bucket_size": 5e8,
                                     "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    cfg = DeepSpeedConfig.load(gptlite)
    assert cfg.zero_optimization.stage == 3 and cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.offload_param_device == "cpu"
    zero2 = {"train_batch_size": 1, "fp16": {"enabled": True},
             "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                   "offload_optimizer": {"device": "cpu", "pin_memory": True, "fast_init": True}}}
    assert DeepSpeedConfig.load(zero2).zero_optimization.offload_optimizer.pin_memory is True
    legacy = DeepSpeedConfig.load({"train_batch_size": 8, "zero_optimization": True})
    assert legacy.zero_optimization.stage == 1
    assert DeepSpeedConfig.load({"train_batch_size": 8, "zero_optimization": False}).zero_optimization.stage == 0


def test_unregistered_stage_is_one_clear_error(monkeypatch):
    import dslaunch.runtime.zero  # noqa: F401  (the strategies register themselves in the real registry first)
    import dslaunch.runtime.strategy as strategy

    monkeypatch.setattr(strategy, "_REGISTRY", {k: v for k, v in strategy._REGISTRY.items() if k == 0})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage: stage 2 is not available in this build"):
        strategy_for_stage(2)
    assert strategy_for_stage(0).__name__ == "DataParallelStrategy"


def _opt():
    import torch

    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)


def test_optimizers_by_deepspeed_name():
    import torch

    from dslaunch.runtime.config import OptimizerConfig

    p = [torch.nn.Parameter(torch.zeros(2))]
    from dslaunch.runtime.ops.adam import FusedAdam

    # CPU parameters, no offload: DeepSpeed's class for them, FusedAdam (stepped by the SIMD kernel)
    adamw = build_optimizer(OptimizerConfig("Adam", {"lr": 0.1}), p)
    assert isinstance(adamw, FusedAdam) and adamw.param_groups[0]["decoupled_weight_decay"] and adamw.adam_w_mode
    adam = build_optimizer(OptimizerConfig("Adam", {"adam_w_mode": False}), p)
    assert isinstance(adam, FusedAdam) and not adam.param_groups[0]["decoupled_weight_decay"]
    assert isinstance(build_optimizer(OptimizerConfig("sgd", {"lr": 0.1, "momentum": 0.9}), p), torch.optim.SGD)
    with pytest.raises(ConfigError, match=r"optimizer.params.lrr: not a parameter of Adam; did you mean 'lr'\?"):
        build_optimizer(OptimizerConfig("Adam", {"lrr": 0.1}), p)
    with pytest.raises(ConfigError, match=r"optimizer.type: unknown optimizer 'Adamm'; did you mean 'adam'\?"):
        build_optimizer(OptimizerConfig("Adamm", {}), p)


def test_schedules_follow_deepspeed_formulas():
    import math

    from dslaunch.runtime.config import SchedulerConfig

    opt = _opt()
    s = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    lrs = [opt.param_groups[0]["lr"]] + [(s.step(), opt.param_groups[0]["lr"])[1] for _ in range(12)]
    # DeepSpeed 0.19.8's WarmupLR, same arguments: the lr each of the first 13 optimizer steps uses
    ds = [0.0, 0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0]
    assert [round(x, 12) for x in lrs] == ds
    s = WarmupLR(_opt(), warmup_max_lr=1.0, warmup_num_steps=100)  # log warm-up
    s.step(9)
    assert math.isclose(s.get_lr()[0], math.log(10) / math.log(100))
    d = WarmupDecayLR(_opt(), total_num_steps=20, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    d.step(15)
    assert math.isclose(d.get_lr()[0], 0.5)
    d.step(25)
    assert d.get_lr()[0] == 0.0
    c = WarmupCosineLR(_opt(), total_num_steps=20, warmup_num_steps=10, cos_min_ratio=0.0, warmup_type="linear")
    assert c.optimizer.param_groups[0]["lr"] == 0.0  # before the first step, as DeepSpeed's
    c.step(15)
    assert math.isclose(c.get_lr()[0], 0.5 * 0.34549150281252633)  # DeepSpeed 0.19.8: ratio 0.3455 of lr 0.5
    o = OneCycle(_opt(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=10)
    assert o.optimizer.param_groups[0]["lr"] == 0.1
    o.step(5)  # DeepSpeed 0.19.8's OneCycle gives 0.64 and momentum 0.84 here, 0.46 at 15, 0.1 at 25
    assert math.isclose(o.get_lr()[0], 0.64) and math.isclose(o.optimizer.param_groups[0]["lr"], 0.64)
    assert math.isclose(o.optimizer.param_groups[0]["momentum"], 0.84)  # momentum cycles inversely
    assert [(round(m, 12), b) for m, b in o.get_mom()] == [(0.84, None)]  # SGD: no second beta
    o.step(15)
    assert math.isclose(o.get_lr()[0], 0.46)
    o.step(25)
    assert math.isclose(o.get_lr()[0], 0.1)
    state = o.state_dict()
    o2 = OneCycle(_opt(), cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=10)
    o2.load_state_dict(state)
    assert o2.get_lr() == o.get_lr()
    for staircase, ds in ((False, [0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.045, 0.05]),
                          (True, [0.01, 0.01, 0.01, 0.01, 0.03, 0.03, 0.03, 0.03, 0.05])):
        # DeepSpeed 0.19.8's LRRangeTest, same arguments: the lr before and after each of 8 steps
        opt = _opt()
        r = build_scheduler(SchedulerConfig("LRRangeTest", {
            "lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": staircase}), opt)
        lrs = [opt.param_groups[0]["lr"]] + [(r.step(), opt.param_groups[0]["lr"])[1] for _ in range(8)]
        assert [round(x, 12) for x in lrs] == ds
    with pytest.raises(ConfigError, match=r"lr_range_test_step_size: must be a positive integer, got 0"):
        build_scheduler(SchedulerConfig("LRRangeTest", {"lr_range_test_step_size": 0}), _opt())
    with pytest.raises(ConfigError, match=r"scheduler.params: WarmupDecayLR needs total_num_steps"):
        build_scheduler(SchedulerConfig("WarmupDecayLR", {}), _opt())
    with pytest.raises(ConfigError, match=r"scheduler.type: unknown scheduler 'WarmupLr'; did you mean 'WarmupLR'\?"):
        build_scheduler(SchedulerConfig("WarmupLr", {}), _opt())



def test_a_batch_filled_in_for_one_process_by_accelerate_on_cpu_names_the_cause_and_the_fix(monkeypatch):
    """The HF Trainer on a CPU-only machine without the gloo recipe: Accelerate saw a world
    of 1 and filled "auto" with it; the error says so and gives the recipe."""
    import sys
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = DeepSpeedConfig.load({"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                                "gradient_accumulation_steps": 2})
    monkeypatch.delitem(sys.modules, "accelerate", raising=False)
    with pytest.raises(ConfigError, match=r"train_batch_size 4 != 2 x 2 x 2 = 8"):
        resolve_batch_sizes(cfg, 2)  # no Accelerate: the plain rule
    monkeypatch.setitem(sys.modules, "accelerate", types.ModuleType("accelerate"))
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(cfg, 2)
    msg = str(info.value)
    assert msg.startswith('batch size: train_batch_size 4 = 2 x 2 x 1 was filled in ("auto") for a world of 1 '
                          "process, but this is data-parallel size 2 (world size): on a machine without GPUs "
                          "Accelerate starts no process group for DeepSpeed.")
    assert 'accelerate.PartialState(backend="gloo")' in msg and '"use_configured_state": True' in msg
