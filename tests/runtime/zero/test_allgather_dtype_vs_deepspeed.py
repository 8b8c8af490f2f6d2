"""`deepspeed.runtime.zero.partition_parameters.get_allgather_dtype` (zero/params.py) against
DeepSpeed 0.19.8's recorded answers (scripts/make_ds_allgather_dtype_fixtures.py), and the
dtype stage 3's gather really carries: a parameter's shard travels in the dtype the function
names (dslaunch marks no parameter with an autocast comm dtype, core/autocast.py).
"""
from __future__ import annotations

import json

import pytest
import torch

import repo_paths
from dist_harness import run_function

FIXTURE = repo_paths.DATA / "ds_allgather_dtype.json"
CASES = json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['param']}-{c['shard']}-{c['comm']}")
def test_get_allgather_dtype_equals_deepspeed(case):
    import dslaunch.runtime  # noqa: F401  (installs DeepSpeed's paths)
    from dslaunch.runtime.torch_autocast import PARAM_COMM_DTYPE_ATTR_NAME
    from dslaunch.runtime.zero.partition_parameters import get_allgather_dtype

    param = torch.nn.Parameter(torch.zeros(4, dtype=getattr(torch, case["param"])))
    if case["comm"] is not None:
        setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, getattr(torch, case["comm"]))
    shard = torch.zeros(2, dtype=getattr(torch, case["shard"]))
    assert str(get_allgather_dtype(param, shard)) == f"torch.{case['allgather']}"


def _gathered_dtypes():
    import torch

    from dslaunch.runtime.zero import params
    from dslaunch.runtime.zero.partition_parameters import get_allgather_dtype

    # a bfloat16 weight and a float32 adapter in one gather, as a mixed-dtype model's module has them
    weight = torch.nn.Parameter(torch.arange(6, dtype=torch.bfloat16))
    adapter = torch.nn.Parameter(torch.full((5, ), 1 + 2 ** -20, dtype=torch.float32))  # not a bfloat16 value
    for name, p in (("weight", weight), ("adapter", adapter)):
        params.partition_param(p, name=name)
    pending = params.start_gather([weight, adapter], what="test")
    carried = {str(p.dtype): str(leg.out.dtype) for leg in pending.legs for p in leg.params}
    pending.finish()
    named = {str(p.dtype): str(get_allgather_dtype(p, p._zero.shard)) for p in (weight, adapter)}
    return named, carried, adapter.data.tolist()


def test_stage3_gather_carries_the_dtype_named():
    named, carried, adapter = run_function(_gathered_dtypes, nprocs=1)[0]
    assert named == {"torch.bfloat16": "torch.bfloat16", "torch.float32": "torch.float32"}
    assert carried == named
    assert adapter == [1 + 2 ** -20] * 5
