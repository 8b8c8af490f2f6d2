"""What the console shows while a job runs and fails, through the real CLI: output never
holds up supervision (a reader that does not read), the first failure's own output then
one summary, follow-on errors collapsed to one line per victim, every line in --log_dir."""
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslaunch.launcher.failure import Failure
from dslaunch.launcher.output import AttemptSummary, JobOutput, OutputLine
import repo_paths
from dist_harness import DSLAUNCH

BEHAVE = str(repo_paths.WORKERS / "behave.py")


def _wait_for(path: Path, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("how", ["rank fails", "SIGINT"])
def test_a_reader_that_never_reads_does_not_delay_the_stop(tmp_path, how):
    """Rank 0 floods stdout into a pipe nobody reads. The stop still reaches the workers
    within 1 s of the failure (or of Ctrl-C) while not one byte has been read; the lines
    the console could not take are counted, and every line is in --log_dir."""
    out = tmp_path / "flood"
    mode = "fail" if how == "rank fails" else "wait"
    proc = subprocess.Popen([*DSLAUNCH, "--num_gpus", "2", "--kill_grace", "20", "--log_dir", str(tmp_path / "logs"),
                             BEHAVE, "flood", str(out), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path)
    try:
        for r in (0, 1):
            _wait_for(Path(f"{out}.ready.{r}"), proc)
        # more than the 64 KiB pipe to us and dslaunch's 8 MiB console buffer together: lines are being dropped
        deadline = time.monotonic() + 90
        while not (Path(f"{out}.bytes").exists() and int(Path(f"{out}.bytes").read_text() or 0) > 10 << 20):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        if how == "SIGINT":
            t_cause = time.time()
            proc.send_signal(signal.SIGINT)
        else:
            Path(f"{out}.go").touch()
            _wait_for(Path(f"{out}.failed"), proc)
            t_cause = float(Path(f"{out}.failed").read_text())
        stopped = Path(f"{out}.stopped.0")
        _wait_for(stopped, proc, timeout=30)  # still not a byte read from dslaunch's stdout
        assert float(stopped.read_text()) - t_cause < 1.0
    finally:
        stdout, stderr = proc.communicate(timeout=60)  # now read: dslaunch shows what it kept and ends
    err = stderr.decode()
    assert proc.returncode == (3 if how == "rank fails" else 130), err
    assert "worker line(s) were not shown: the console did not keep up (every line is in" in err
    assert len(stdout) > 1 << 20  # the console buffer's worth, not everything
    assert (tmp_path / "logs" / "rank_0.log").stat().st_size > len(stdout)


@pytest.mark.timeout(90)
def test_follow_on_errors_are_collapsed_and_the_first_failure_shown_once(tmp_path):
    r = subprocess.run([*DSLAUNCH, "--num_gpus", "2", "--log_dir", "logs", BEHAVE, "cascade", str(tmp_path / "c"),
                        "victim"], capture_output=True, text=True, cwd=tmp_path, timeout=80)
    assert r.returncode == 1, r.stderr
    err = r.stderr.splitlines()
    ours = [line for line in err if not line.startswith("dslaunch: no GPU")]
    assert ours[:4] == [
        "[rank 1] Traceback (most recent call last):",  # torch's own `[rank1]: ` prefix is not doubled
        '[rank 1]   File "train.py", line 7, in <module>',
        "[rank 1]     ValueError: ds_config: unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)",
        "[rank 1] ValueError: ds_config: unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)",
    ]
    assert ours[4].startswith("dslaunch: rank 1 failed first: exited with code 1 after ")
    assert ours[5:] == [
        f"dslaunch: rank 0: also failed; 4 line(s) not shown, all in {Path('logs') / 'rank_0.log'}",
    ] or ours[5:] == [
        f"dslaunch: rank 0: stopped after rank 1 failed; 4 line(s) not shown, all in {Path('logs') / 'rank_0.log'}",
        "dslaunch: stopped the other 1 of 2 worker(s)",
    ]
    assert "Connection closed by peer" not in r.stderr
    log0 = (tmp_path / "logs" / "rank_0.log").read_text()
    assert "[rank0]: RuntimeError: [gloo] Connection closed by peer" in log0  # every line kept, unprefixed


@pytest.mark.timeout(90)
def test_the_same_error_on_every_rank_is_shown_once(tmp_path):
    """Without --log_dir, the hidden lines are kept in a temporary folder the summary names."""
    r = subprocess.run([*DSLAUNCH, "--num_gpus", "2", BEHAVE, "cascade", str(tmp_path / "c"), "same"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=80,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("unknown key 'zero_optimisation'") == 2  # one traceback: the error line and its source
    assert r.stderr.count("Traceback (most recent call last):") == 1
    assert "--log_dir keeps" not in r.stderr
    kept = [line for line in r.stderr.splitlines() if "line(s) not shown, all in " in line]
    assert len(kept) == 1, r.stderr
    path = Path(kept[0].rsplit(" all in ", 1)[1])
    assert path.parent.parent == tmp_path and path.parent.name.startswith("dslaunch-run-")
    assert "unknown key 'zero_optimisation'" in path.read_text()


def test_console_policy_for_errors_written_in_the_same_instant(tmp_path):
    """The same one-line error from two ranks a moment apart: the failing rank's shows, the
    other's (still within the stderr delay) is counted; stdout is never delayed or hidden
    before the failure. With no --log_dir, the hidden lines are in the file the summary names."""
    out, err = io.BytesIO(), io.BytesIO()
    o = JobOutput(out, err, delay_s=30, traceback_s=30, tail_root=str(tmp_path))  # long delays: no timing
    o.line(OutputLine(0, "rank 0", "stderr", b"error: bad key\n"))
    o.line(OutputLine(0, "rank 0", "stdout", b"step 1\n"))
    o.line(OutputLine(1, "rank 1", "stderr", b"[rank1]: error: bad key\n"))
    o.failed(Failure(1, "rank 1", 2, elapsed_s=1.0))
    o.line(OutputLine(0, "rank 0", "stderr", b"[rank0]: Traceback (most recent call last):\n"))
    o.line(OutputLine(1, "rank 1", "stdout", b"bye\n"))
    o.summary(AttemptSummary(Failure(1, "rank 1", 2, elapsed_s=1.0), {"rank 0": "stopped"}, 2))
    o.close()
    kept = next(tmp_path.glob("dslaunch-run-*")) / "rank_0.log"
    assert out.getvalue() == b"[rank 0] step 1\n[rank 1] bye\n"
    assert err.getvalue().decode().splitlines() == [
        "[rank 1] error: bad key",
        "dslaunch: rank 1 failed first: exited with code 2 after 1.0s",
        f"dslaunch: rank 0: stopped after rank 1 failed; 2 line(s) not shown, all in {kept}",
        "dslaunch: stopped the other 1 of 2 worker(s)",
    ]
    assert kept.read_bytes() == b"error: bad key\nstep 1\n[rank0]: Traceback (most recent call last):\n"


def test_after_ctrl_c_a_keyboard_interrupt_traceback_is_not_shown_but_another_error_is(tmp_path):
    """Once the launcher passed SIGINT on, each rank's KeyboardInterrupt traceback is the
    stop working; a traceback that ends in another exception (raised while handling the
    interrupt) is still an error the user must see."""
    out, err = io.BytesIO(), io.BytesIO()
    o = JobOutput(out, err, delay_s=30, traceback_s=30, tail_root=str(tmp_path))
    o.stopping(signal.SIGINT)
    for rank in (0, 1):
        for text in (b"Traceback (most recent call last):\n", b'  File "t.py", line 3, in <module>\n',
                     b"    time.sleep(60)\n", b"KeyboardInterrupt\n"):
            o.line(OutputLine(rank, f"rank {rank}", "stderr", text))
    o.exited("rank 0")
    o.line(OutputLine(1, "rank 1", "stderr", b"\nDuring handling of the above exception, another exception "
                                              b"occurred:\n"))
    o.line(OutputLine(1, "rank 1", "stderr", b"OSError: checkpoint not written\n"))
    o.say("stopped by SIGINT; all 2 worker(s) ended")
    o.close()
    shown = err.getvalue().decode().splitlines()
    assert shown[-2:] == ["[rank 1] OSError: checkpoint not written", "dslaunch: stopped by SIGINT; all 2 worker(s) ended"]
    assert not any(line.startswith("[rank 0]") for line in shown), shown
    assert "[rank 1] KeyboardInterrupt" in shown  # part of the block that ends in the OSError


def test_without_log_dir_only_the_last_lines_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr("dslaunch.launcher.output.TAIL_LINES", 3)
    out, err = io.BytesIO(), io.BytesIO()
    o = JobOutput(out, err, tail_root=str(tmp_path))
    f = Failure(1, "rank 1", 2, elapsed_s=1.0)
    o.failed(f)
    for i in range(5):
        o.line(OutputLine(0, "rank 0", "stdout", f"line {i}\n".encode()))
    o.summary(AttemptSummary(f, {"rank 0": "stopped"}, 2))
    o.close()
    kept = next(tmp_path.glob("dslaunch-run-*")) / "rank_0.log"
    assert f"rank 0: stopped after rank 1 failed; 5 line(s) not shown, its last 3 lines in {kept}" in err.getvalue().decode()
    assert kept.read_text() == "line 2\nline 3\nline 4\n"


def test_progress_frames_are_plain_periodic_lines_when_the_console_is_no_terminal():
    """tqdm-style frames (bare carriage returns) on a console that is a pipe or a file: the
    first frame and the bar's last line, each on a line of its own with one prefix; the
    frames in between are not shown there; the log file keeps every byte."""
    out, err = io.BytesIO(), io.BytesIO()
    o = JobOutput(out, err)
    frames = [b"\r"] + [f"{i:3d}%|{'#' * (i // 10):10s}|\r".encode() for i in range(0, 100, 5)]
    for data in frames + [b"100%|##########|\n", b"done\n"]:
        o.line(OutputLine(0, "rank 0", "stdout", data))
    o.close()
    assert out.getvalue().decode().splitlines() == ["[rank 0]   0%|          |", "[rank 0] 100%|##########|",
                                                    "[rank 0] done"]
    assert b"\r" not in out.getvalue()


def test_progress_frames_stay_frames_on_a_terminal():
    class Tty(io.BytesIO):
        def isatty(self):
            return True

    out = Tty()
    o = JobOutput(out, io.BytesIO())
    for data in (b" 10%|#\r", b" 20%|##\r", b"100%|###\n"):
        o.line(OutputLine(0, "rank 0", "stdout", data))
    o.close()
    assert out.getvalue().count(b"\r") == 2 and out.getvalue().count(b"[rank 0]") == 3


class _Tty(io.BytesIO):
    def isatty(self):
        return True


def test_worker_control_characters_are_escaped_on_the_console_and_kept_in_the_log(tmp_path, monkeypatch):
    """A worker cannot set the title, clear the screen, back over the prefix or forge
    another rank's line; colour stays; the log file has the bytes as written."""
    monkeypatch.setenv("NO_COLOR", "1")
    out, err = _Tty(), io.BytesIO()
    o = JobOutput(out, err, log_dir=str(tmp_path))
    o.start_attempt(0, [0, 1])
    written = [b"\x1b]0;pwned\x07title\n", b"\x1b[2J\x1b[Hcleared\n", b"\x1b[31mred\x1b[0m caf\xc3\xa9\n",
               b"\x08\x08\x08\x08\x08\x08\x08\x08\x08[rank 1] forged\n", b"\x9b2J 8-bit\n",
               b"50%|#####     |\r"]
    for data in written:
        o.line(OutputLine(0, "rank 0", "stdout", data))
    o.line(OutputLine(1, "rank 1", "stdout", b"hi\n"))
    o.close()
    assert out.getvalue().split(b"\n") == [
        b"[rank 0] \\x1b]0;pwned\\x07title",
        b"[rank 0] \\x1b[2J\\x1b[Hcleared",
        b"[rank 0] \x1b[31mred\x1b[0m caf\xc3\xa9",
        b"[rank 0] " + b"\\x08" * 9 + b"[rank 1] forged",
        b"[rank 0] \\x9b2J 8-bit",
        b"[rank 0] 50%|#####     |\r\x1b[2K[rank 1] hi",  # the frame's line is erased before rank 1 writes
        b"",
    ]
    assert (tmp_path / "rank_0.log").read_bytes().split(b"===\n", 1)[1] == b"".join(written)


def test_a_carriage_return_in_a_line_gives_each_piece_our_prefix():
    """Through the supervisor's line cutting: `fake\\r[rank 1] x` from rank 0 is two pieces,
    each with rank 0's prefix."""
    from dslaunch.launcher.supervisor import Supervisor, WorkerSpec

    class Collect:
        def __init__(self):
            self.lines = []

        def line(self, line):
            self.lines.append(line.data)

        def failed(self, failure):
            pass

        def exited(self, label):
            pass

    obs = Collect()
    script = "import sys; sys.stdout.write('[rank 0] fine then\\r[rank 1] forged\\n')"
    Supervisor([WorkerSpec(0, [sys.executable, "-c", script], dict(os.environ))], obs, watchdog=False,
               subreaper=False).run()
    assert obs.lines == [b"[rank 0] fine then\r", b"[rank 1] forged\n"]
    out = io.BytesIO()
    o = JobOutput(out, io.BytesIO())
    for data in obs.lines:
        o.line(OutputLine(0, "rank 0", "stdout", data))
    o.close()
    assert out.getvalue() == b"[rank 0] [rank 0] fine then\n[rank 0] [rank 1] forged\n"


@pytest.mark.parametrize("how", ["link", "fifo", "hard_link", "another_users_file", "open_folder", "group_folder"])
@pytest.mark.timeout(60)
def test_log_dir_never_writes_through_what_another_user_planted(tmp_path, how):
    """--log_dir in a folder others can write: `rank_0.log -> /victim` (or a FIFO, a hard link,
    another user's file there) gets no byte, and a folder other users can write is refused
    before anything starts. One line, exit 2, no worker started."""
    if how == "another_users_file" and os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    logs, victim = tmp_path / "logs", tmp_path / "victim"
    logs.mkdir()
    victim.write_text("precious\n")
    rank0 = logs / "rank_0.log"
    expect = {"link": f"{rank0}: log file is a symbolic link; refusing to write through it",
              "fifo": f"{rank0}: log file is a FIFO, not a regular file",
              "hard_link": f"{rank0}: log file has 2 hard links",
              "another_users_file": f"{rank0}: log file is owned by nobody (uid 65534), not by you",
              "open_folder": f"--log_dir {logs}: every user (mode 0777) can write there",
              "group_folder": f"--log_dir {logs}: group "}[how]
    if how == "link":
        rank0.symlink_to(victim)
    elif how == "fifo":
        os.mkfifo(rank0)
    elif how == "hard_link":
        os.link(victim, rank0)
    elif how == "another_users_file":
        rank0.write_text("")
        os.chown(rank0, 65534, 65534)
    elif how == "open_folder":
        os.chmod(logs, 0o777)
    else:  # writable by a group others are in (nogroup's gid is no one's own group here)
        os.chown(logs, os.geteuid(), 65534)
        os.chmod(logs, 0o775)
    r = subprocess.run([*DSLAUNCH, "--log_dir", str(logs), BEHAVE, "env", str(tmp_path / "ran")],
                       capture_output=True, text=True, timeout=50, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and expect in lines[0], r.stderr
    assert victim.read_text() == "precious\n" and not list(tmp_path.glob("ran*"))


def test_log_dir_appends_to_our_own_files(tmp_path):
    """The checks refuse only what another user could have planted: a second run appends."""
    logs = tmp_path / "logs"
    for _ in range(2):
        r = subprocess.run([*DSLAUNCH, "--log_dir", str(logs), BEHAVE, "args"], capture_output=True, text=True,
                           timeout=50, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    assert (logs / "rank_0.log").read_text().count("=== dslaunch run") == 2
