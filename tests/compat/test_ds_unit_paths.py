"""DeepSpeed module paths and config keys its own unit tests import or set, each behaving as
DeepSpeed 0.19.8's (recorded in tests/data/ds_dszero.json by scripts/make_ds_dszero_fixtures.py,
cases in scripts/dszero_cases.py):

- deepspeed.runtime.precision_config.DeepSpeedFP16Config: the values it accepts and refuses
  (pydantic's ValidationError), loss_scale_window / min_loss_scale checked only under dynamic scaling;
- zero_optimization.leaf_module and set_z3_leaf_modules_by_name / _by_suffix / by class name;
- deepspeed.runtime.zero.tiling.TiledLinear: tiles, outputs and gradients;
- zero_optimization.ignore_unused_parameters false (stages 1-2 with offload stop on an unused
  parameter) and contiguous_gradients false (same step);
- deepspeed.utils.pin_memory (the native backend refused in one line) and
  partition_parameters.MultipleAllGatherHandles.
One process, tiny models."""
import json
import sys

import pytest
import torch

from repo_paths import DATA, SCRIPTS  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
import dszero_cases as cases  # noqa: E402

import dslaunch.runtime as deepspeed  # noqa: E402
from dslaunch.runtime.strict import ConfigError  # noqa: E402

DS = json.loads((DATA / "ds_dszero.json").read_text())


def test_every_case_has_deepspeeds_answer_on_record():
    assert DS["deepspeed"] == "0.19.8"
    assert set(DS["fp16"]) == set(cases.FP16_CASES) and set(DS["tiled"]) == set(cases.TILED_CASES)
    assert set(DS["unused"]) == set(cases.UNUSED_CASES) and set(DS["leaf_calls"]) == set(cases.LEAF_CALL_CASES)


# -- precision_config ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(cases.FP16_CASES))
def test_fp16_config_model_accepts_and_refuses_as_deepspeed(name):
    from pydantic import ValidationError

    from dslaunch.runtime.precision_config import DeepSpeedFP16Config

    want = DS["fp16"][name]
    kwargs = cases.FP16_CASES[name]
    if want["outcome"] == "refused":
        with pytest.raises(ValidationError) as info:
            DeepSpeedFP16Config(**kwargs)
        assert "config: fp16." in str(info.value)  # our one line, naming the key, inside it
        return
    cfg = DeepSpeedFP16Config(**kwargs)
    assert isinstance(cfg, DeepSpeedFP16Config)
    got = {k: getattr(cfg, k) for k in ("loss_scale", "loss_scale_window", "min_loss_scale")}
    assert got == {k: want[k] for k in got}


def test_a_whole_config_takes_unused_scaler_values_as_deepspeed_and_refuses_them_when_dynamic():
    from dslaunch.runtime.config import DeepSpeedConfig

    DeepSpeedConfig.load({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale": 64, "min_loss_scale": 0}})
    with pytest.raises(ConfigError, match=r"^config: fp16.min_loss_scale: must be > 0, got 0"):
        DeepSpeedConfig.load({"train_batch_size": 1, "fp16": {"enabled": True, "min_loss_scale": 0}})


def test_bf16_config_model_is_the_bf16_section():
    from dslaunch.runtime.config import BF16Config
    from dslaunch.runtime.precision_config import DeepSpeedBF16Config

    cfg = DeepSpeedBF16Config(enabled=True)
    assert isinstance(cfg, BF16Config) and isinstance(cfg, DeepSpeedBF16Config) and cfg.enabled


# -- leaf modules ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(cases.LEAF_CONFIG_CASES))
def test_leaf_module_section_parses_as_deepspeed(name):
    from dslaunch.runtime.zero.config import DeepSpeedZeroConfig

    section = cases.LEAF_CONFIG_CASES[name]
    cfg = DeepSpeedZeroConfig() if section is None else DeepSpeedZeroConfig(leaf_module=section)
    lm = cfg.leaf_module
    assert {"classes": lm.classes, "names": lm.names, "name_suffixes": lm.name_suffixes} == DS["leaf_config"][name]


def test_leaf_module_section_refuses_what_is_not_names():
    from dslaunch.runtime.zero.config import DeepSpeedZeroConfig

    with pytest.raises(ConfigError, match=r"leaf_module.names"):
        DeepSpeedZeroConfig(leaf_module={"names": [1]})


@pytest.mark.parametrize("name", sorted(cases.LEAF_CALL_CASES))
def test_leaf_marking_calls_mark_what_deepspeed_marks(name):
    from dslaunch.runtime.zero import hook_scope  # where DeepSpeed's utils names for these live here

    assert cases.leaf_call(hook_scope, *cases.LEAF_CALL_CASES[name], hook_scope.z3_leaf_module) == \
        DS["leaf_calls"][name]


def test_leaf_marking_by_name_raises_on_a_missing_name_unless_told_not_to():
    from dslaunch.runtime.zero.hook_scope import set_z3_leaf_modules_by_name, set_z3_leaf_modules_by_suffix

    with pytest.raises(ValueError, match="nope"):
        set_z3_leaf_modules_by_name(cases.Net(), ["first", "nope"])
    with pytest.raises(ValueError, match="zzz"):
        set_z3_leaf_modules_by_suffix(cases.Net(), ["zzz"])


def test_engine_marks_the_configured_leaves_at_build_time():
    from dslaunch.runtime.zero.hook_scope import z3_leaf_module

    class Model(cases.Net):
        def forward(self, x):
            return self.head(self.first.inner(x)).sum()

    model = Model()
    deepspeed.initialize(model=model, model_parameters=model.parameters(),
                         config={"train_batch_size": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
                                 "zero_optimization": {"stage": 1, "leaf_module": {
                                     "classes": [f"{cases.__name__}.Block"], "name_suffixes": ["head"]}}})
    assert sorted(n for n, m in model.named_modules() if z3_leaf_module(m)) == ["first", "head", "second"]


# -- TiledLinear -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(cases.TILED_CASES))
def test_tiled_linear_matches_deepspeeds(name):
    from dslaunch.runtime.zero.tiling import TiledLinear

    in_f, out_f, bias, in_splits, out_splits = cases.TILED_CASES[name]
    want = DS["tiled"][name]
    base = torch.nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        base.weight.copy_(torch.tensor(want["weight"]))
        if bias:
            base.bias.copy_(torch.tensor(want["bias"]))
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=base)
    assert (tiled.in_parts, tiled.out_parts) == (want["in_parts"], want["out_parts"])
    assert [[t.bias is not None for t in row] for row in tiled.linears] == want["tile_bias"]
    out = tiled(torch.tensor(want["x"]))
    torch.testing.assert_close(out, torch.tensor(want["out"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, base(torch.tensor(want["x"])), rtol=1e-5, atol=1e-6)  # one linear's answer
    out.pow(2).sum().backward()
    for row, want_row in zip(tiled.linears, want["tile_grads"]):
        for tile, g in zip(row, want_row):
            torch.testing.assert_close(tile.weight.grad, torch.tensor(g), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", sorted(cases.TILED_BAD))
def test_tiled_linear_refuses_bad_splits_as_deepspeed(name):
    from dslaunch.runtime.zero.tiling import TiledLinear

    in_f, out_f, in_splits, out_splits = cases.TILED_BAD[name]
    assert DS["tiled_bad"][name] == "RuntimeError"
    with pytest.raises(RuntimeError, match="splits"):
        TiledLinear(in_f, out_f, in_splits=in_splits, out_splits=out_splits)


def test_tiled_linear_return_bias_passes_the_tiles_biases_through():
    from dslaunch.runtime.zero.tiling import TiledLinearReturnBias

    class BiasOut(torch.nn.Linear):  # Megatron-style: returns its bias instead of adding it
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight), self.bias

    base = torch.nn.Linear(6, 4)
    tiled = TiledLinearReturnBias(6, 4, in_splits=2, out_splits=2, linear_cls=BiasOut, init_linear=base)
    x = torch.randn(3, 6)
    out, bias = tiled(x)
    torch.testing.assert_close(out, x @ base.weight.T)
    torch.testing.assert_close(bias, base.bias.detach())


# -- ignore_unused_parameters / contiguous_gradients --------------------------------------------
@pytest.mark.parametrize("name", sorted(cases.UNUSED_CASES))
def test_unused_parameters_stop_the_step_where_deepspeeds_do(name):
    from dslaunch.runtime.zero.fragments import safe_get_full_fp32_param

    want = DS["unused"][name]
    engine = cases.unused_engine(deepspeed, cases.UNUSED_CASES[name])
    if want["outcome"] == "refused":
        assert want["error"] == "AssertionError" and want["names_key"]
        with pytest.raises(AssertionError, match=r"ignore_unused_parameters.*$") as info:
            engine.step()
        assert "unused.weight" in str(info.value) and "\n" not in str(info.value)
        return
    engine.step()
    torch.testing.assert_close(safe_get_full_fp32_param(engine.module.used.weight),
                               torch.tensor(want["used_weight"]), rtol=1e-5, atol=1e-6)


# -- pin_memory / gather handles -----------------------------------------------------------------
def test_native_pinning_is_refused_in_one_line_and_torch_pinning_stays(monkeypatch):
    from dslaunch.runtime.accelerator import get_accelerator
    from dslaunch.runtime.utils.pin_memory import NativePinnedMemory, get_active_native_pinned_memory

    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    assert get_active_native_pinned_memory() is None
    t = torch.ones(3)
    assert torch.equal(get_accelerator().pin_memory(t), t)
    with pytest.raises(RuntimeError, match="DS_PIN_MEMORY_BACKEND=native.*not provided"):
        NativePinnedMemory()
    assert get_accelerator().unpin_memory(t) is None  # torch frees pinned memory itself
    from dslaunch.runtime.ops.op_builder import PinMemoryBuilder

    assert PinMemoryBuilder().is_compatible() is False
    with pytest.raises(RuntimeError, match="pin_memory op cannot run here"):
        PinMemoryBuilder().load()
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    for call in (get_active_native_pinned_memory, lambda: get_accelerator().pin_memory(t),
                 lambda: get_accelerator().unpin_memory(t)):
        with pytest.raises(RuntimeError, match="not provided") as info:
            call()
        assert "\n" not in str(info.value)


def test_multiple_all_gather_handles_wait_each_by_keyword():
    from dslaunch.runtime.zero.partition_parameters import MultipleAllGatherHandles, partitioned_param_data_shape

    seen = []

    class Positional:
        def wait(self, handle_dependency=True):
            seen.append(("positional", handle_dependency))

    class KeywordOnly:
        def wait(self, *, handle_dependency=True):
            seen.append(("keyword", handle_dependency))

    MultipleAllGatherHandles([Positional(), KeywordOnly()]).wait(handle_dependency=False)
    assert seen == [("positional", False), ("keyword", False)]
    assert partitioned_param_data_shape == [0]


# -- stage3_module_granularity_threshold -------------------------------------------------------
@pytest.mark.parametrize("threshold", cases.GRANULARITY_THRESHOLDS)
def test_granularity_threshold_makes_deepspeeds_leaves_and_keeps_the_losses(threshold):
    from dslaunch.runtime.zero.hook_scope import z3_leaf_module

    want = DS["granularity"][str(threshold)]
    got = cases.granularity_run(deepspeed, threshold, z3_leaf_module)
    assert got["marked"] == want["marked"]
    losses = got["losses"]
    assert losses == pytest.approx(want["losses"], rel=1e-5, abs=1e-7)


def test_leaves_train_with_inputs_that_need_no_gradient():
    """Better than DeepSpeed: its leaf modules fail in backward when the leaf's input needs no
    gradient (its unit test expects that RuntimeError); here the leaf's gathered parameters get
    their gradients either way, and the losses are those of the same run without leaves."""
    from dslaunch.runtime.zero.hook_scope import z3_leaf_module

    # no leaf; the whole model one leaf
    runs = [cases.granularity_run(deepspeed, threshold, z3_leaf_module, input_grad=False)["losses"]
            for threshold in (0, 10_000_000)]
    assert runs[0] == runs[1]
    assert runs[0] == pytest.approx(DS["granularity"]["0"]["losses"], rel=1e-5)


def test_zero_init_sets_up_the_process_group_as_deepspeeds_does(tmp_path):
    """deepspeed.zero.Init() with no process group yet initialises it (DeepSpeed's Init calls
    init_distributed), then partitions: run in a child process, from the launcher's environment."""
    import os
    import subprocess
    import textwrap

    from dist_harness import free_port

    script = tmp_path / "init.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        import dslaunch.runtime as deepspeed
        assert not dist.is_initialized()
        with deepspeed.zero.Init():
            assert dist.is_initialized()
            layer = torch.nn.Linear(4, 4)
        print("OK", dist.get_world_size(), hasattr(layer.weight, "ds_status"))
    """))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "OK 1 True"
