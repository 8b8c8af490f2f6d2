"""Micro-batch gradients accumulate in DeepSpeed 0.19.8's dtype, data_types.grad_accum_dtype,
whose default is the model dtype (bf16 here), so a bf16 run rounds its sums as DeepSpeed's
does: at ZeRO stages 2 and 3 the reduced partitions sum in it, and stage 1 sums in param.grad
(the default) or in param.grad_accum (fp32 written), as DeepSpeed's stage 1 does.

Both sides run scripts/grad_accum_case.py (2 ranks, 4 bf16 micro-batches, one SGD step at lr 1,
so each fp32 master moves by its accumulated gradient); DeepSpeed's answers are in
tests/data/ds_grad_accum.json (scripts/make_ds_grad_accum_fixtures.py), recorded on one CPU.
Another CPU may round a bf16 matmul otherwise, so the recording is not compared bit for bit:
each answer must lie within bf16's rounding of DeepSpeed's, and nearer DeepSpeed's answer for
its own accumulation dtype than to DeepSpeed's for the other one (where the recording was made,
ours equals DeepSpeed's exactly). What must be exact on any machine is checked inside one run:
the default is the model dtype, bit for bit.
"""
import json
import os

import pytest

from dist_harness import run_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CASE_SCRIPT = os.path.join(ROOT, "scripts", "grad_accum_case.py")
FIXTURE = os.path.join(ROOT, "tests", "data", "ds_grad_accum.json")
BF16_STEP = 2.0 ** -8  # bf16's relative rounding step; a sum of 4 roundings stays within 2 of them


def _key(case):
    return case["stage"], case["offload"], case["accum"]


def _deepspeed():
    with open(FIXTURE) as fh:
        return {_key(c): c for c in json.load(fh)["cases"]}


def _flat(case):
    return [x for name in sorted(case["delta"]) for x in case["delta"][name]]


def _distance(a, b):
    return sum(abs(x - y) for x, y in zip(_flat(a), _flat(b)))


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
def test_accumulated_gradients_are_deepspeeds(tmp_path):
    ds = _deepspeed()
    cases = list(ds) + [(s, o, "bf16") for s, o, a in ds if a == "default"]
    runs = run_script([CASE_SCRIPT, "dslaunch"] + [f"{s}:{o}:{a}" for s, o, a in cases], nprocs=2, timeout=380,
                      cwd=str(tmp_path))
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    ours = {_key(c): c for c in (json.loads(ln[len("RESULT "):]) for ln in runs[0].stdout.splitlines()
                                 if ln.startswith("RESULT "))}
    assert list(ours) == cases and all(c["steps"] == 1 for c in ours.values())
    for stage, offload, accum in ds:
        if accum == "default":  # not written: the model dtype, exactly (one run, one machine)
            assert ours[stage, offload, "default"]["delta"] == ours[stage, offload, "bf16"]["delta"], (stage, offload)
        mine, theirs = ours[stage, offload, accum], ds[stage, offload, accum]
        other = ds[stage, offload, "fp32" if accum == "default" else "default"]
        for name, want in theirs["delta"].items():
            bound = 2 * BF16_STEP * max(abs(x) for x in want)
            worst = max(abs(a - b) for a, b in zip(mine["delta"][name], want))
            assert worst <= bound, f"{(stage, offload, accum)} {name}: {worst:.3g} from DeepSpeed's (bound {bound:.3g})"
        # the accumulation dtype is DeepSpeed's: nearer its answer than to its other dtype's
        assert _distance(mine, theirs) < _distance(mine, other), (stage, offload, accum)
