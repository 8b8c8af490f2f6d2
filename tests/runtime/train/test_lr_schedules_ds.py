"""DeepSpeed's LR schedules' newer parameters against DeepSpeed 0.19.8's own numbers
(tests/data/ds_lr_schedules.json, written by scripts/make_ds_lr_fixture.py under real
DeepSpeed): OneCycle's stair counts, decay and per-group bounds, WarmupLR's default
maximum (each group's own lr), and a tensor lr filled in place, not replaced.

Momentum: dslaunch's OneCycle keeps each group's second beta where DeepSpeed's writes 0.99,
so only the first beta (the cycled momentum) is compared.
"""
import json
import sys

import pytest
import torch

from dslaunch.runtime.lr_schedules import OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR
from dslaunch.runtime.strict import ConfigError
import repo_paths

ROOT = repo_paths.ROOT
sys.path.insert(0, str(repo_paths.SCRIPTS))
from ds_lr_cases import ONE_CYCLE_CASES, STEPS  # noqa: E402

DS = json.loads((ROOT / "tests" / "data" / "ds_lr_schedules.json").read_text())


def _two_groups():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    return torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}], betas=(0.9, 0.99))


def _lrs(opt):
    return [float(g["lr"]) for g in opt.param_groups]


def _flat(rows):
    return [x for row in rows for x in (row if isinstance(row, list) else [row])]


def _same(got, ds):
    """Equal to DeepSpeed's to a relative 1e-12 (the same formulas, summed in another order)."""
    assert len(got) == len(ds)
    assert _flat(got) == pytest.approx(_flat(ds), rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("case", sorted(ONE_CYCLE_CASES))
def test_one_cycle_matches_deepspeed(case):
    opt = _two_groups()
    s = OneCycle(opt, **ONE_CYCLE_CASES[case])
    lrs, moms = [_lrs(opt)], []
    for _ in range(STEPS):
        s.step()
        lrs.append(_lrs(opt))
        moms.append([m for m, _ in s.get_mom()])
        assert [g["betas"][0] for g in opt.param_groups] == moms[-1]
        assert [g["betas"][1] for g in opt.param_groups] == [0.99, 0.99]  # the group's own, kept
    _same(lrs, DS[case]["lrs"])
    _same(moms, DS[case]["moms"])


def test_one_cycle_stairs_hold_the_lr_flat():
    opt = _two_groups()
    s = OneCycle(opt, **ONE_CYCLE_CASES["stairs"])
    seen = [(s.step(), opt.param_groups[0]["lr"])[1] for _ in range(15)]
    assert len(set(seen[:5])) == 3  # stairs up over six steps: two steps on each, then the peak
    assert seen[1] == seen[2] != seen[3] == seen[4]


def test_warmup_lr_defaults_to_each_groups_lr_and_fills_a_tensor_lr():
    opt = _two_groups()
    w = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    got = [_lrs(opt)] + [(w.step(), _lrs(opt))[1] for _ in range(5)]
    _same(got, DS["warmup_inherit"])
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    c = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4)
    got = [float(lr)] + [(c.step(), float(lr))[1] for _ in range(6)]
    assert opt.param_groups[0]["lr"] is lr  # filled in place: the caller's tensor follows the schedule
    _same(got, DS["cosine_tensor"])
    assert c.get_lr_ratio() * 0.1 == pytest.approx(got[-1])
    # 0 (the Hugging Face Trainer's "auto" without warmup) stays accepted, where DeepSpeed 0.19.8
    # refuses it: a warmup of 2 steps, as DeepSpeed before
    z = WarmupLR(_two_groups(), warmup_num_steps=0, warmup_type="linear")
    z.step(1)
    assert z.get_lr() == pytest.approx([0.05, 0.1])


@pytest.mark.parametrize("make, message", [
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size: must be positive, got 0"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-1), "cycle_second_step_size: must be 0 or more"),
    (lambda o: OneCycle(o, 0.1, 1.0, cycle_first_stair_count=-2), "cycle_first_stair_count: must be a whole"),
    (lambda o: OneCycle(o, [0.1, 0.2, 0.3], 1.0), r"cycle_min_lr: expected 2 values \(one per param group\), got 3"),
    (lambda o: WarmupLR(o, warmup_num_steps=-5), "warmup_num_steps: must be a whole number of steps, got -5"),
    (lambda o: WarmupDecayLR(o, total_num_steps=10, warmup_num_steps=None), "warmup_num_steps: must be a whole number of steps, got None"),
])
def test_bad_schedule_arguments_are_one_line(make, message):
    with pytest.raises(ConfigError, match=message):
        make(_two_groups())
