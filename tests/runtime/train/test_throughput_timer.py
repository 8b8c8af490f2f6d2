"""engine.tput_timer, DeepSpeed's throughput timer: its counters move as DeepSpeed's do (the
sequence of DeepSpeed's test_throughput_calculation), the engine starts it at each forward
and stops it at each step(), warm-up steps are not timed, and timers.throughput.enabled
false stops it."""
import math
import time
from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_function
from dslaunch.runtime.train.throughput import ThroughputTimer


def _timer(enabled=True, **kw):
    return ThroughputTimer(SimpleNamespace(enabled=enabled, synchronized=True), **kw)


def test_counters_follow_deepspeeds_sequence():
    gas, t = 3, _timer(batch_size=12)
    assert (t.batch_size, t.start_step, t.initialized, t.started) == (12, 2, False, False)
    t.stop()  # before any start: nothing moves
    assert (t.micro_step_count, t.global_step_count, t.total_elapsed_time) == (0, 0, 0)
    while t.micro_step_count < gas * t.start_step:  # warm-up: counted, not timed
        t.start()
        t.stop(global_step=(t.micro_step_count + 1) % gas == 0)
    assert (t.global_step_count, t.total_elapsed_time, t.start_time) == (2, 0, 0)
    assert t.avg_samples_per_sec() == -math.inf
    for micro in range(gas):
        t.start()
        time.sleep(0.01)
        before_step, before_total = t.step_elapsed_time, t.total_elapsed_time
        t.stop(global_step=micro == gas - 1)
        duration = t.end_time - t.start_time
        assert duration > 0
        assert t.total_elapsed_time == pytest.approx(before_total + duration)
        assert t.step_elapsed_time == (0 if micro == gas - 1 else pytest.approx(before_step + duration))
    assert t.global_step_count == 3
    assert t.avg_samples_per_sec() == pytest.approx(12 / t.total_elapsed_time)


def test_disabled_timer_stays_still():
    t = _timer(enabled=False)
    for _ in range(3):
        t.start()
        t.stop(global_step=True)
    assert (t.initialized, t.micro_step_count, t.global_step_count) == (False, 0, 0)


def engine_body(enabled):
    import dslaunch.runtime as deepspeed

    model = torch.nn.Linear(4, 2)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "timers": {"throughput": {"enabled": enabled}}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    t = engine.tput_timer
    out = {"batch_size": t.batch_size}
    for _ in range(4 * 2):  # 4 global steps of 2 micro-steps
        engine.backward(engine(torch.randn(2, 4)).square().mean())
        engine.step()
    out.update(micro=t.micro_step_count, glob=t.global_step_count, total=t.total_elapsed_time,
               rate=t.avg_samples_per_sec())
    return out


@pytest.mark.parametrize("enabled", [True, False])
def test_engine_drives_the_timer(enabled):
    out = run_function(engine_body, nprocs=2, kwargs={"enabled": enabled}, timeout=120)[0]
    assert out["batch_size"] == 8  # 2 per micro-step x 2 steps x 2 ranks
    if enabled:
        assert (out["micro"], out["glob"]) == (8, 4)
        assert out["total"] > 0 and out["rate"] == pytest.approx(8 / (out["total"] / 2))
    else:
        assert (out["micro"], out["glob"], out["total"]) == (0, 0, 0)
