"""The OneCycle cases scripts/make_ds_lr_fixture.py runs under DeepSpeed and
tests/runtime/train/test_lr_schedules_ds.py runs here (one list, so the two cannot drift apart)."""
STEPS = 22
ONE_CYCLE_CASES = {
    # per-group bounds, stairs on both halves (3 up, 2 down), then decay every 4 steps
    "stairs": dict(cycle_min_lr=[0.001, 0.002], cycle_max_lr=[0.01, 0.03], cycle_first_step_size=6,
                   cycle_second_step_size=9, cycle_first_stair_count=3, cycle_second_stair_count=2,
                   decay_step_size=4, decay_lr_rate=0.5, cycle_min_mom=[0.8, 0.85], cycle_max_mom=[0.9, 0.95],
                   decay_mom_rate=0.01),
    # the second half takes the first half's size and stair count
    "stairs_default_second": dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=8,
                                  cycle_first_stair_count=4),
    # continuous, asymmetric, no decay
    "continuous": dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=5, cycle_second_step_size=7),
}
