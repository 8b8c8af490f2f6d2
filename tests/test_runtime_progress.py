"""Rank 0's progress line: every steps_per_print steps, with step, window-mean loss, lr,
samples/s, loss scale and skipped steps; plain text when not on a terminal."""
import io

from dslaunch.runtime.progress import ProgressLog


def test_progress_line_every_n_steps_plain_when_piped():
    out = io.StringIO()
    log = ProgressLog(steps_per_print=2, enabled=True, wall_clock_breakdown=True, stream=out)
    log.add_loss(3.0)
    log.add_time("forward", 0.004)
    assert log.step_done(1, 8, 0.001, 1024.0, 0) is None
    log.add_loss(1.0)
    log.add_time("forward", 0.002)
    line = log.step_done(2, 8, 0.001, 1024.0, 1)
    assert line.startswith("step 2 | loss 2.0000 | lr 1.000e-03 | ")
    assert " samples/s | loss scale 1024 | skipped 1 | forward 3.0ms" in line
    assert out.getvalue() == line + "\n"


def test_other_ranks_print_nothing():
    out = io.StringIO()
    log = ProgressLog(steps_per_print=1, enabled=False, stream=out)
    log.add_loss(1.0)
    assert log.step_done(1, 4, 0.1, None, 0).startswith("step 1 | loss 1.0000")
    assert out.getvalue() == ""


def test_terminal_output_goes_through_rich():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    log = ProgressLog(steps_per_print=1, enabled=True, stream=out)
    assert log._console is not None
    log.add_loss(0.5)
    log.step_done(7, 4, 0.1, None, 0)
    assert "step      7" in out.getvalue() and "loss 0.5000" in out.getvalue()
