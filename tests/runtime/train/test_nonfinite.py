"""Non-finite steps in fp32/bf16 (issue #9 item 9): skipped, said on the progress line,
and training stops after `nonfinite_check.max_consecutive_steps` in a row, naming them.

The engine test poisons the input of two ranks with NaN at chosen steps: two bad steps in
a row are survived (weights stay finite, later steps train), three stop the job with one
line and exit status 2. fp32 with stage 0, and bf16 with ZeRO-2 (whose norm is reduced
across ranks).
"""
import json
import math

import pytest

from dist_harness import run_script

SCRIPT = r'''
import json, math, os, sys
import torch
import dslaunch.runtime as deepspeed

precision, stage = sys.argv[1], int(sys.argv[2])
poison = {3, 4, 7, 8, 9}  # optimizer steps (1-based) whose input is NaN on every rank
cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 100,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage},
       "nonfinite_check": {"max_consecutive_steps": 3}}
if precision == "bf16":
    cfg["bf16"] = {"enabled": True}
if len(sys.argv) > 3:  # DeepSpeed's own switch written, and no nonfinite_check: DeepSpeed's answer
    cfg["bf16"]["check_grad_overflow"] = sys.argv[3] == "true"
    del cfg["nonfinite_check"]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
rank = engine.global_rank
for step in range(1, 13):
    for micro in range(2):
        g = torch.Generator().manual_seed(step * 10 + micro + 100 * rank)
        x = torch.randn(4, 8, generator=g)
        if step in poison:
            x[0, 0] = float("nan")
        loss = engine(x.to(engine.compute_dtype)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    finite = all(bool(torch.isfinite(p.detach().float()).all()) for p in engine.module.parameters())
    print("STEP " + json.dumps({"step": engine.global_steps, "applied": engine.was_step_applied(),
                                "finite": finite, "skipped": engine.skipped_steps}), flush=True)
print("not reached", flush=True)
'''


@pytest.mark.timeout(200)
@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("bf16", 2)])
def test_nonfinite_steps_are_skipped_reported_and_stop_the_job(tmp_path, precision, stage):
    script = tmp_path / "nan.py"
    script.write_text(SCRIPT)
    runs = run_script([str(script), precision, str(stage)], nprocs=2, timeout=180)
    for rank, run in enumerate(runs):
        assert run.returncode == 2, run.stderr[-3000:]
        steps = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("STEP ")]
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6, 7, 8]  # step 9 raised
        assert [s["applied"] for s in steps] == [True, True, False, False, True, True, False, False]
        assert all(s["finite"] for s in steps)  # the NaN steps never reached the weights
        assert steps[-1]["skipped"] == 4
        assert "not reached" not in run.stdout
        last = run.stderr.strip().splitlines()[-1]
        assert last == ("error: training stopped at step 9: the gradient norm was NaN or infinite for 3 consecutive "
                        "steps (steps 7-9); the weights are those after step 6. Lower the learning rate or check "
                        "the data, or raise nonfinite_check.max_consecutive_steps"), run.stderr[-2000:]
    # rank 0's progress line says so at once, whatever steps_per_print is
    alerts = [ln for ln in runs[0].stdout.splitlines() if "non-finite gradient norm" in ln]
    assert len(alerts) == 5, runs[0].stdout[-2000:]
    assert alerts[0].startswith("step 3 | non-finite gradient norm (nan, loss nan): update skipped (1 of 3 in a row")
    assert alerts[-1].startswith("step 9 | ") and alerts[-1].endswith("update skipped (3 of 3 in a row allowed)")
    assert not any("non-finite" in ln for ln in runs[1].stdout.splitlines())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("check", ["true", "false"])
def test_bf16_check_grad_overflow_written_gives_deepspeeds_answer(tmp_path, check, stage):
    """DeepSpeed's TestZeROBFloat16 test_detect_grad_overflow / test_ignore_grad_overflow:
    with bf16.check_grad_overflow written, every non-finite step is skipped and training
    goes on (true), or the update is applied and the weights become NaN (false). Stage 3
    too, where DeepSpeed ignores the key and applies: here it is obeyed."""
    script = tmp_path / "nan.py"
    script.write_text(SCRIPT)
    runs = run_script([str(script), "bf16", str(stage), check], nprocs=2, timeout=180)
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
        steps = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("STEP ")]
        assert [s["step"] for s in steps] == list(range(1, 13)) and "not reached" in run.stdout
        if check == "true":
            assert [s["step"] for s in steps if not s["applied"]] == [3, 4, 7, 8, 9]
            assert all(s["finite"] for s in steps) and steps[-1]["skipped"] == 5
        else:
            assert all(s["applied"] for s in steps) and steps[-1]["skipped"] == 0
            assert [s["finite"] for s in steps[:3]] == [True, True, False] and not steps[-1]["finite"]
    assert not any("non-finite" in ln for ln in runs[0].stdout.splitlines())  # the guard stayed out


def test_guard_counts_streaks_and_names_the_steps():
    from dslaunch.runtime.nonfinite import NonFiniteError, NonFiniteGuard

    g = NonFiniteGuard(max_consecutive_steps=2)
    assert g.observe(1, 0.5, 1.0) is None
    assert g.observe(2, math.nan, math.nan) == "non-finite gradient norm (nan, loss nan): update skipped (1 of 2 in a row allowed)"
    g.check(2)
    assert g.observe(3, 1.0, 2.0) is None and g.streak == 0  # a finite step resets the count
    assert g.observe(4, 1.0, math.inf) == "non-finite loss (inf) with a finite gradient norm: update applied"
    g.observe(5, math.inf, 1.0)
    g.observe(6, math.nan, 1.0)
    with pytest.raises(NonFiniteError, match=r"stopped at step 6: .* for 2 consecutive steps \(steps 5-6\); "
                                             r"the weights are those after step 4"):
        g.check(6)
    assert g.total == 3
