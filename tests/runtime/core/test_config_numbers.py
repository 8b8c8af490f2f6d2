"""Numbers and keys that poison training are refused where the config is read, in one line
naming the key: NaN and Infinity, numbers written as strings, booleans where a number
belongs, values out of range, keys given twice, and nesting deep enough to break a
recursive reader (scripts/config_number_cases.py). DeepSpeed 0.19.8's answer for each is
recorded in tests/data/ds_config_numbers.json (scripts/make_ds_config_number_fixtures.py):
it trains with some of them (a negative lr, betas above 1, a boolean lr) and fails with a
traceback on others; dslaunch refuses every one."""
import inspect
import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import repo_paths

ROOT = repo_paths.ROOT
sys.path.insert(0, str(repo_paths.SCRIPTS))
from config_number_cases import CASES  # noqa: E402

import dslaunch.runtime as deepspeed  # noqa: E402
from dslaunch.runtime.config import DeepSpeedConfig  # noqa: E402
from dslaunch.runtime.config.numbers import SCHEDULER_PARAMS, optimizer_rules  # noqa: E402
from dslaunch.runtime.lr_schedules import SCHEDULES  # noqa: E402
from dslaunch.runtime.optim import OPTIMIZERS  # noqa: E402
from dslaunch.runtime.strict import ConfigError, MAX_DEPTH  # noqa: E402

DS = json.loads((ROOT / "tests" / "data" / "ds_config_numbers.json").read_text())


def test_every_case_has_deepspeeds_answer_on_record():
    assert DS["deepspeed"] == "0.19.8"
    assert set(DS["cases"]) == set(CASES)
    # what the record shows: DeepSpeed trains with some of these without a word
    trained = {name for name, r in DS["cases"].items() if r["outcome"] == "trained"}
    assert {"lr_negative", "lr_true", "betas_above_one"} <= trained


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_is_one_line_naming_the_key(tmp_path, name):
    text, line = CASES[name]
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        DeepSpeedConfig.load(str(path))
    assert str(info.value) == f"{path}: {line}"
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["lr_nan", "lr_infinity", "lr_string", "lr_negative", "lr_true",
                                  "betas_above_one", "clipping_nan", "duplicate_top_key"])
def test_initialize_refuses_before_any_step(tmp_path, name):
    """The cases of the report, through initialize(): refused, nothing trained."""
    text, line = CASES[name]
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError) as info:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=str(path))
    assert str(info.value) == f"{path}: {line}"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_script_gets_one_line_and_exit_2(tmp_path):
    text, line = CASES["lr_string"]  # a TypeError from the CPU Adam kernel before
    (tmp_path / "ds.json").write_text(text)
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import dslaunch.runtime as deepspeed
        model = torch.nn.Linear(4, 2)
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config="ds.json")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"error: ds.json: {line}"


def test_a_dict_from_a_script_is_held_to_the_same_rules():
    with pytest.raises(ConfigError, match=r"^config: optimizer.params.lr: must be finite, got NaN$"):
        DeepSpeedConfig.load({"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": math.nan}}})
    with pytest.raises(ConfigError, match=r"^config: fp16.loss_scale: must be finite, got Infinity$"):
        DeepSpeedConfig.load({"train_batch_size": 2, "fp16": {"loss_scale": math.inf}})
    with pytest.raises(ConfigError, match=r"^config: gradient_clipping: 1(0)+ is out of range$"):
        DeepSpeedConfig.load({"train_batch_size": 2, "gradient_clipping": 10 ** 400})
    with pytest.raises(ConfigError, match=r"^config: train_batch_size: 1(0)+ is out of range \(a 64-bit integer\)$"):
        DeepSpeedConfig.load({"train_batch_size": 10 ** 20})
    with pytest.raises(ConfigError, match=r"^config: fp16.initial_scale_power: must be between -126 and 127, "
                                          r"got 2000$"):
        DeepSpeedConfig.load({"train_batch_size": 2, "fp16": {"enabled": True, "initial_scale_power": 2000}})
    with pytest.raises(ConfigError, match=r"^config: fp16.loss_scale: must be between 0 and 3.4\d*e\+38, got 1e\+300$"):
        DeepSpeedConfig.load({"train_batch_size": 2, "fp16": {"enabled": True, "loss_scale": 1e300}})
    looped: dict = {"train_batch_size": 2}
    looped["optimizer"] = {"type": "Adam", "params": {"x": looped}}  # refers to itself: no RecursionError
    with pytest.raises(ConfigError, match=f"nested more than {MAX_DEPTH} deep"):
        DeepSpeedConfig.load(looped)


def _nested(levels: int) -> dict:
    """A config whose deepest object sits `levels` deep (the config itself is level 1)."""
    inner: dict = {}
    for _ in range(levels - 4):
        inner = {"a": inner}
    return {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"x": inner}}}


def test_infinity_where_it_means_never_and_the_limit_of_nesting():
    assert DeepSpeedConfig.load({"train_batch_size": 2, "steps_per_print": math.inf}).steps_per_print == math.inf
    DeepSpeedConfig.load(_nested(MAX_DEPTH))
    with pytest.raises(ConfigError, match=f"nested more than {MAX_DEPTH} deep"):
        DeepSpeedConfig.load(_nested(MAX_DEPTH + 1))


def test_yaml_keys_given_twice_and_aliases_are_refused(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("train_batch_size: 4\ntrain_batch_size: 8\n")
    with pytest.raises(ConfigError, match=r"ds.yaml:2:1: invalid YAML: the key 'train_batch_size' is given twice"):
        DeepSpeedConfig.load(str(path))
    # a few lines that stand for 10^9 values once the aliases are expanded
    path.write_text("a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n" for p, c in zip("abcdefgh", "bcdefghi")))
    with pytest.raises(ConfigError, match=r"ds.yaml:2:\d+: invalid YAML: anchors and aliases are not supported"):
        DeepSpeedConfig.load(str(path))


def _arguments(fn, skip):
    return {name: p for name, p in inspect.signature(fn).parameters.items()
            if name not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _as_json(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_argument_has_a_rule_its_default_keeps(name):
    builder = OPTIMIZERS[name]
    rules = optimizer_rules(name)
    for arg, p in _arguments(getattr(builder, "signature_of", builder), ("self", "params", "target", "_cls")).items():
        assert arg in rules, f"{name}: {arg} has no rule in runtime/config/numbers.py"
        if p.default is not p.empty:
            rules[arg](f"{name}.{arg}", _as_json(p.default))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_argument_has_a_rule_its_default_keeps(name):
    for arg, p in _arguments(SCHEDULES[name].__init__, ("self", "optimizer")).items():
        assert arg in SCHEDULER_PARAMS, f"{name}: {arg} has no rule in runtime/config/numbers.py"
        if p.default is not p.empty:
            SCHEDULER_PARAMS[arg](f"{name}.{arg}", _as_json(p.default))


def test_values_that_train_still_load():
    cfg = DeepSpeedConfig.load({
        "train_batch_size": 2, "gradient_clipping": 0,
        "optimizer": {"type": "Adam", "params": {"lr": 0, "betas": [0, 0.999], "eps": 0, "weight_decay": 0.1}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [0.0, 0.1], "cycle_max_lr": 1,
                                                     "cycle_second_step_size": None, "cycle_min_mom": 0.8}},
        "fp16": {"loss_scale": 128, "min_loss_scale": 0.5}})
    assert cfg.optimizer.params["betas"] == [0, 0.999] and cfg.gradient_clipping == 0.0
    DeepSpeedConfig.load({"train_batch_size": 2, "optimizer": {"type": "Adafactor", "params": {"eps": [None, 1e-3]}}})
    DeepSpeedConfig.load({"train_batch_size": 2, "optimizer": {"type": "Rprop", "params": {"etas": [0.4, 1.3]}}})


def test_the_autotuner_reads_the_config_with_the_same_refusal(tmp_path):
    from dslaunch.launcher.autotune.config import load_user_config
    from dslaunch.launcher.errors import LaunchConfigError

    path = tmp_path / "ds.json"
    path.write_text(CASES["duplicate_top_key"][0])
    with pytest.raises(LaunchConfigError, match=r"ds.json: train_batch_size: the key is given more than once; "
                                                r"DeepSpeed refuses duplicate keys too: keep one$"):
        load_user_config(str(path))


def test_an_odd_allgather_bucket_is_refused_at_stages_1_and_2_as_deepspeed_asserts():
    """DeepSpeed's stage 1-2 optimizer asserts allgather_bucket_size % nccl_start_alignment_factor
    (2) == 0 (its TestIncorectAllgatherBucketSize); the same words, raised as an AssertionError
    too, where the config is read. Stage 0 and 3 never read the key."""
    def load(stage, size):
        DeepSpeedConfig.load({"train_batch_size": 2,
                              "zero_optimization": {"stage": stage, "allgather_bucket_size": size}})

    for stage in (1, 2):
        with pytest.raises(AssertionError, match=r"^config: zero_optimization\.allgather_bucket_size: 1001: "
                                                 r"allgather_bucket_size must be a multiple of "
                                                 r"nccl_start_alignment_factor, 2 "):
            load(stage, 1001)
        load(stage, 1000)
    for stage in (0, 3):
        load(stage, 1001)
