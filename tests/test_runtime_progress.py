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
    assert line.startswith("step 7 (epoch 1 3/4) |") and "ETA" in line
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
