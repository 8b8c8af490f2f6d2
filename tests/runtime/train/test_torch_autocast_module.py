"""`deepspeed.runtime.torch_autocast` (runtime/core/autocast.py) and the engine's forward under
the `torch_autocast` section, against real DeepSpeed 0.19.8's recorded run
(scripts/make_ds_autocast_fixtures.py, tests/autocast_workload.py).

Where dslaunch differs on purpose: it reduces every gradient in the parameter's own dtype
(fp32), so `get_comm_dtype` of a Linear's weight is float32 here where DeepSpeed says bfloat16
(it marks Linear/Conv parameters and reduces their gradients in the autocast dtype); and a
caller's autocast around an engine whose torch_autocast is off is switched off inside the
forward on the engine's device (DeepSpeed looks at CUDA's autocast only, so on CPU it leaves it on).
"""
from __future__ import annotations

import json
import os

import torch

import repo_paths
from dist_harness import run_function

HERE = str(repo_paths.TESTS)
FIXTURE = os.path.join(HERE, "data", "ds_autocast", "expected.json")


def autocast_body():
    import autocast_workload
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import torch_autocast

    out = {"bf16": autocast_workload.train(deepspeed, torch_autocast, {"enabled": True, "dtype": "bfloat16"}),
           "off": autocast_workload.train(deepspeed, torch_autocast, {"enabled": False})}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's own autocast, the engine's off
        out["nested_off"] = autocast_workload.train(deepspeed, torch_autocast, {"enabled": False})
    with torch.autocast("cpu", dtype=torch.float16):  # the engine's bf16 replaces the caller's fp16
        out["nested_bf16"] = autocast_workload.train(deepspeed, torch_autocast, {"enabled": True, "dtype": "bf16"})
    return out


def test_engine_forward_under_torch_autocast_equals_deepspeed():
    expected = json.load(open(FIXTURE))["cases"]
    got = run_function(autocast_body, nprocs=1, timeout=240, env={"PYTHONPATH": HERE})[0]
    for case in ("bf16", "off"):
        losses, seen, comm = got[case]
        want_losses, want_seen, want_comm = expected[case]
        assert seen == want_seen, case
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-6, (case, losses, want_losses)
        # no parameter is marked: every gradient is reduced in its own dtype (see the docstring)
        assert set(comm.values()) == {"torch.float32"} and set(comm) == set(want_comm)
    # DeepSpeed's answer there: the Linear's parameters reduced in bf16, the LayerNorm's in fp32
    assert expected["bf16"][2] == {"linear.weight": "torch.bfloat16", "linear.bias": "torch.bfloat16",
                                   "norm.weight": "torch.float32", "norm.bias": "torch.float32"}
    # nested: the forward sees the engine's setting, whatever the caller's (backward and step
    # still run under the caller's autocast, so only the first loss is the same as without it)
    assert got["nested_off"][1] == [[False, "torch.float32"]] * 3
    assert got["nested_off"][0][0] == got["off"][0][0]
    assert got["nested_bf16"][1] == expected["bf16"][1] and got["nested_bf16"][0][0] == got["bf16"][0][0]


def test_comm_dtype_helpers():
    from dslaunch.runtime import torch_autocast as ta

    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float16))
    assert not ta.has_comm_dtype(p) and ta.get_comm_dtype(p) == torch.float16
    setattr(p, ta.PARAM_COMM_DTYPE_ATTR_NAME, torch.bfloat16)  # a script's own mark is read back
    assert ta.has_comm_dtype(p) and ta.get_comm_dtype(p) == torch.bfloat16
    assert ta.get_all_comm_dtypes([p, torch.zeros(1)]) == {torch.bfloat16, torch.float32}
    assert ta.sort_dtypes([torch.float32, torch.bfloat16, torch.float16]) == [torch.bfloat16, torch.float16,
                                                                               torch.float32]
    assert ta.get_default_autocast_lower_precision_modules() == [
        "torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d", "torch.nn.modules.conv.Conv2d",
        "torch.nn.modules.conv.Conv3d"]
