"""Precision paths against real DeepSpeed 0.19.8's recorded runs
(scripts/make_ds_precision_fixtures.py, tests/precision_workload.py):
- how initialize puts a model in fp16/bf16 (runtime/core/module_cast.py): parameters cast,
  buffers kept in their dtype unless data_types.buffer_dtype names one, buffers the model
  names for fp32 kept (and brought back to) fp32; the data_types keys' one-line refusals;
- bf16.immediate_grad_update at ZeRO 1 with grad_accum_dtype fp32 (2 ranks, accumulation 3):
  unset, false and true give DeepSpeed's losses; elsewhere the key is refused in one line;
- zero.Init under a bf16 config: the buffers a module makes in its __init__ become bf16 (less
  those named for fp32), the engine then leaves buffers alone; Init(module=...) casts none."""
from __future__ import annotations

import json
import os

import pytest
import torch

import repo_paths
from dist_harness import run_function

HERE = str(repo_paths.TESTS)
FIXTURE = os.path.join(HERE, "data", "ds_precision", "expected.json")
# relative, per the dtype the forward runs in: the recording's CPU (AVX-512 or AVX2 kernels) may
# round a bf16/fp16 matmul one step apart from this one's, and the next steps carry it
REL = {"bf16": 2e-2, "fp16": 5e-3}


def _close(got, want, rel):
    return all(abs(a - b) <= rel * max(abs(b), 1.0) for a, b in zip(got, want)) and len(got) == len(want)


def cast_body():
    import precision_workload
    import dslaunch.runtime as deepspeed

    return {name: precision_workload.train(deepspeed, name) for name in precision_workload.CASES}


def accumulation_body():
    import torch.distributed as dist

    import precision_workload
    import dslaunch.runtime as deepspeed

    return {name: precision_workload.train_accumulation(deepspeed, name, dist.get_rank())
            for name in precision_workload.ACCUM_CASES}


def test_module_cast_equals_deepspeed():
    expected = json.load(open(FIXTURE))["cases"]
    got = run_function(cast_body, nprocs=1, timeout=240, env={"PYTHONPATH": HERE})[0]
    assert set(got) == set(expected)
    for case, (want_losses, want_dtypes) in expected.items():
        losses, dtypes = got[case]
        assert dtypes == want_dtypes, case
        assert _close(losses, want_losses, REL[case.split("_")[0]]), (case, losses, want_losses)
    # what the cases show: the rotary buffer's low digits survive bf16 training only when kept fp32
    assert expected["bf16_default_z0"][0] != expected["bf16_buffer_bf16_z0"][0]


def test_immediate_grad_update_equals_deepspeed():
    expected = json.load(open(FIXTURE))["accumulation"]
    got = run_function(accumulation_body, nprocs=2, timeout=240, env={"PYTHONPATH": HERE})
    for rank in (0, 1):
        assert set(got[rank]) == set(expected[rank])
        for case, want in expected[rank].items():
            assert _close(got[rank][case], want, REL["bf16"]), (rank, case, got[rank][case], want)


def test_immediate_grad_update_outside_deepspeeds_bf16_optimizer_is_refused():
    from dslaunch.runtime.strict import ConfigError

    on = {"enabled": True, "immediate_grad_update": True}
    fp32_accum = {"grad_accum_dtype": "fp32"}
    cfg = _config(fp32_accum, bf16=on, zero_optimization={"stage": 1})
    assert cfg.bf16.immediate_grad_update is True
    for extra in ({"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 0}},
                  {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}):
        with pytest.raises(ConfigError, match=r"^config: bf16.immediate_grad_update: only read at ZeRO stage 1 "
                                              r"with bf16, data_types.grad_accum_dtype fp32"):
            _config(fp32_accum, bf16=on, **extra)
    with pytest.raises(ConfigError, match="bf16.immediate_grad_update: only read at"):
        _config({}, bf16=on, zero_optimization={"stage": 1})
    assert _config({}, bf16={"enabled": True, "immediate_grad_update": False}).bf16.immediate_grad_update is False


def zero_init_body():
    import precision_workload
    import dslaunch.runtime as deepspeed

    return precision_workload.zero_init_buffers(deepspeed)


def test_zero_init_buffer_dtypes_equal_deepspeed():
    expected = json.load(open(FIXTURE))["zero_init"]
    got = run_function(zero_init_body, nprocs=1, timeout=240, env={"PYTHONPATH": HERE})[0]
    assert got == expected
    # what DeepSpeed's answer is: built in the context, bf16 but the named buffer; the engine keeps
    # what the script set after Init, unless data_types.buffer_dtype says
    assert expected["bf16"][0] == {"inv": "torch.bfloat16", "keep": "torch.float32", "later": "torch.bfloat16"}
    assert expected["bf16"][1]["later"] == "torch.float32"


def _net():
    import precision_workload

    return precision_workload.make_net()


def test_cast_module_rules():
    from dslaunch.runtime.core.module_cast import cast_module, keep_in_fp32_pattern

    net = _net()
    net.linear.weight.grad = torch.ones_like(net.linear.weight)
    cast_module(net, torch.float16, None, keep=keep_in_fp32_pattern(net, "auto", torch.float16))
    assert net.linear.weight.dtype == net.linear.weight.grad.dtype == torch.float16
    assert (net.inv_freq.dtype, net.route_bias.dtype, net.count.dtype) == (torch.float32, torch.float32, torch.int64)

    net = _net()  # zero.Init gave the parameters their dtype: only buffers move
    cast_module(net, torch.bfloat16, torch.float16, cast_params=False, keep=None)
    assert net.linear.weight.dtype == torch.float32
    assert (net.inv_freq.dtype, net.route_bias.dtype, net.count.dtype) == (torch.float16, torch.float16, torch.int64)

    # under fp32 training nothing is kept (nothing is cast); a nested model's list is scoped to it
    assert keep_in_fp32_pattern(_net(), "auto", torch.float32) is None
    outer = torch.nn.Module()
    outer.inner = _net()
    outer.register_buffer("route_bias", torch.zeros(2, dtype=torch.bfloat16))
    pattern = keep_in_fp32_pattern(outer, "auto", torch.bfloat16)
    assert pattern.search("inner.route_bias") and not pattern.search("route_bias")


def _config(data_types, **precision):
    from dslaunch.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig.load({"train_micro_batch_size_per_gpu": 1, "data_types": data_types, **precision})


def test_data_types_keys_are_checked_in_one_line():
    from dslaunch.runtime.config.precision import ParamDtypeError
    from dslaunch.runtime.strict import ConfigError

    assert _config({"param_dtype": "bf16"}, bf16={"enabled": True}).param_dtype == "bf16"
    assert _config({"param_dtype": "fp32"}).param_dtype == "fp32"
    with pytest.raises(AssertionError, match=r"data_types.param_dtype: 'fp16' conflicts with the enabled "
                                             r"precision \(bf16\)") as err:
        _config({"param_dtype": "fp16"}, bf16={"enabled": True})
    assert isinstance(err.value, ParamDtypeError) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="data_types.buffer_dtype: applies only with fp16 or bf16 enabled"):
        _config({"buffer_dtype": "bf16"})
    with pytest.raises(ConfigError, match="data_types.buffer_dtype: unknown dtype 'bf8'"):
        _config({"buffer_dtype": "bf8"}, bf16={"enabled": True})
    with pytest.raises(ConfigError, match="keep_in_fp32_modules: must be \"auto\" or a list of name patterns"):
        _config({"keep_in_fp32_modules": "inv_freq"}, bf16={"enabled": True})
    assert _config({"keep_in_fp32_modules": None}).keep_in_fp32_modules == "auto"
