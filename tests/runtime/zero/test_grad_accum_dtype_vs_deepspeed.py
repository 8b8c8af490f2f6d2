"""Micro-batch gradients accumulate in DeepSpeed 0.19.8's dtype, data_types.grad_accum_dtype,
whose default is the model dtype (bf16 here), so a bf16 run rounds its sums exactly as
DeepSpeed's does: at ZeRO stages 2 and 3 the reduced partitions sum in it, and stage 1 sums in
param.grad (the default) or in param.grad_accum (fp32 written), as DeepSpeed's stage 1 does.

Both sides run scripts/grad_accum_case.py (2 ranks, 4 bf16 micro-batches, one SGD step at lr 1,
so each fp32 master moves by its accumulated gradient); DeepSpeed's answers are in
tests/data/ds_grad_accum.json (scripts/make_ds_grad_accum_fixtures.py). They are compared bit
for bit.
"""
import json
import os

import pytest

from dist_harness import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CASE_SCRIPT = os.path.join(ROOT, "scripts", "grad_accum_case.py")
FIXTURE = os.path.join(ROOT, "tests", "data", "ds_grad_accum.json")


def _key(case):
    return case["stage"], case["offload"], case["accum"]


def _deepspeed():
    with open(FIXTURE) as fh:
        return {_key(c): c for c in json.load(fh)["cases"]}


def test_the_fixture_tells_bf16_sums_from_fp32_sums():
    """DeepSpeed's bf16 and fp32 sums differ in every case (in 45 to 93 of the 108 elements), so
    the comparison below can tell one accumulation dtype from the other."""
    ds = _deepspeed()
    for stage in (1, 2, 3):
        for offload in ("none", "cpu"):
            bf16, fp32 = ds[stage, offload, "default"]["delta"], ds[stage, offload, "fp32"]["delta"]
            differ = sum(a != b for name in bf16 for a, b in zip(bf16[name], fp32[name]))
            assert differ >= 40, (stage, offload, differ)


@pytest.mark.timeout(400)
def test_accumulated_gradients_equal_deepspeeds_bit_for_bit(tmp_path):
    ds = _deepspeed()
    runs = run_script([CASE_SCRIPT, "dslaunch"] + [f"{s}:{o}:{a}" for s, o, a in ds], nprocs=2, timeout=380,
                      cwd=str(tmp_path))
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    ours = [json.loads(ln[len("RESULT "):]) for ln in runs[0].stdout.splitlines() if ln.startswith("RESULT ")]
    assert [_key(c) for c in ours] == list(ds)
    for case in ours:
        theirs = ds[_key(case)]
        assert case["steps"] == theirs["steps"] == 1
        for name, delta in theirs["delta"].items():
            differ = sum(a != b for a, b in zip(case["delta"][name], delta))
            assert differ == 0, f"{_key(case)} {name}: {differ} of {len(delta)} elements differ from DeepSpeed's"
