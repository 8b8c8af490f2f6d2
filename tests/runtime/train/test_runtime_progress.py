"""Rank 0's progress line as a metrics sink: every steps_per_print steps, with step[/total]
and ETA when the total is known, the loss labelled as a window mean, lr, samples/s, loss
scale and skipped steps; plain text when not on a terminal."""
import io

from dslaunch.runtime.monitor import LOSS_SCALE, LR, TIMER_EVENT, TRAIN_LOSS, StepRecord
from dslaunch.runtime.progress import ProgressLog, clock


def _rec(step, loss, **kw):
    values = {TRAIN_LOSS: loss, LR: 0.001, LOSS_SCALE: 1024.0}
    values.update(kw.pop("values", {}))
    return StepRecord(step=step, samples=8 * step, values=values, **kw)


def test_progress_line_every_n_steps_plain_when_piped():
    out = io.StringIO()
    log = ProgressLog(steps_per_print=2, enabled=True, wall_clock_breakdown=True, stream=out)
    assert log.write_step(_rec(1, 3.0, values={TIMER_EVENT.format("forward"): 4.0})) is None
    line = log.write_step(_rec(2, 1.0, skipped=1, values={TIMER_EVENT.format("forward"): 2.0}))
    assert line.startswith("step 2 | loss 2.0000 (mean of 2 steps) | lr 1.000e-03 | ")
    assert " samples/s | loss scale 1024 | skipped 1 | forward 3.0ms" in line
    assert out.getvalue() == line + "\n"


def test_total_steps_give_step_over_total_and_eta():
    log = ProgressLog(steps_per_print=1, enabled=False)
    line = log.write_step(_rec(5, 1.0, total_steps=20))
    assert line.startswith("step 5/20 | loss 1.0000 (mean of 1 step) |") and " | ETA 0:00:0" in line
    line = log.write_step(_rec(7, 1.0, epoch_steps=4))
    assert line.startswith("step 7 (epoch 1 3/4) |") and "ETA" not in line  # an epoch's end is not the run's
    assert log.write_step(_rec(8, 1.0, epoch_steps=4)).startswith("step 8 (epoch 1 4/4) |")
    assert clock(3725.2) == "1:02:05"


def test_throughput_off_drops_samples_per_second():
    log = ProgressLog(steps_per_print=1, enabled=False, throughput=False)
    assert "samples/s" not in log.write_step(_rec(1, 1.0))


def test_other_ranks_print_nothing():
    out = io.StringIO()
    log = ProgressLog(steps_per_print=1, enabled=False, stream=out)
    assert log.write_step(_rec(1, 1.0)).startswith("step 1 | loss 1.0000")
    assert out.getvalue() == ""


def test_terminal_output_goes_through_rich():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    log = ProgressLog(steps_per_print=1, enabled=True, stream=out)
    assert log._console is not None
    log.write_step(_rec(7, 0.5))
    assert "step 7" in out.getvalue() and "loss 0.5000 (mean of 1 step)" in out.getvalue()


def _progress_lines(scheduler, train_steps):
    import contextlib

    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 2}}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
        if train_steps:
            engine.set_train_steps(train_steps)
        for _ in range(2):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
    return [line for line in out.getvalue().splitlines() if line.startswith("step ")]


def test_the_run_total_comes_from_set_train_steps_or_the_schedulers_total_num_steps():
    from dist_harness import run_function

    plain, scheduled, explicit = run_function(_progress_cases, nprocs=1, timeout=120)[0]
    assert plain[1].startswith("step 2 | ") and "ETA" not in plain[1]
    assert scheduled[1].startswith("step 2/50 | ") and "| ETA 0:" in scheduled[1]
    assert explicit[1].startswith("step 2/7 | ") and "| ETA 0:" in explicit[1]


def _progress_cases():
    return _progress_lines(False, None), _progress_lines(True, None), _progress_lines(True, 7)
