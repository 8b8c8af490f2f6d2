"""Supervisor through its Python API: whole lines, stream separation, states, teardown.

Process-tree and orphan guarantees are proved through the CLI in test_launch_supervision.py;
these tests run with subreaper=False so the pytest process itself is not changed.
"""
import os
import signal
import sys

import pytest

from dslaunch.launcher.supervisor import GroupResult, Supervisor, WorkerSpec, WorkerState
import repo_paths

BEHAVE = str(repo_paths.WORKERS / "behave.py")


def specs(n, *action):
    return [WorkerSpec(r, [sys.executable, BEHAVE, *action], {**os.environ, "RANK": str(r)}) for r in range(n)]


class Collect:
    """A GroupObserver that keeps everything."""

    def __init__(self):
        self.lines = []
        self.failures = []
        self.exits = []

    def line(self, line):
        self.lines.append((line.rank, line.stream, line.data))

    def failed(self, failure):
        self.failures.append(failure)

    def exited(self, label):
        self.exits.append(label)


def run(specs_, **kw) -> "tuple[GroupResult, Collect]":
    sink = Collect()
    kw.setdefault("kill_grace", 2.0)
    return Supervisor(specs_, sink, subreaper=False, **kw).run(), sink


@pytest.mark.timeout(60)
def test_whole_lines_and_streams():
    result, sink = run(specs(2, "lines", "200"))
    assert result.state is WorkerState.SUCCEEDED and result.exit_code == 0
    assert result.states == {0: WorkerState.SUCCEEDED, 1: WorkerState.SUCCEEDED}
    for r in (0, 1):
        out = [l for rr, s, l in sink.lines if rr == r and s == "stdout"]
        err = [l for rr, s, l in sink.lines if rr == r and s == "stderr"]
        assert out == [f"r{r} line {i} end\n".encode() for i in range(200)] + [f"r{r} no-newline-at-end\n".encode()]
        assert err == [f"Er{r} Eline {i} Eend\n".encode() for i in range(200)]


@pytest.mark.timeout(60)
def test_first_failure_stops_the_group_and_reports_stderr_tail():
    result, sink = run(specs(3, "exit", "1", "7"))
    assert result.state is WorkerState.FAILED and result.exit_code == 7
    f = result.failure
    assert (f.rank, f.exit_code, f.signal) == (1, 7, None)
    assert f.stderr_tail[-1] == "rank 1 is failing"
    assert f.describe().startswith("rank 1 failed first: exited with code 7")
    assert sink.failures == [f]  # told once, before teardown
    assert sorted(sink.exits) == ["rank 0", "rank 2"]
    assert result.states == {0: WorkerState.STOPPED, 1: WorkerState.FAILED, 2: WorkerState.STOPPED}
    assert result.exit_codes[0] == result.exit_codes[2] == 128 + signal.SIGTERM
    assert result.teardown_s < 1.0


@pytest.mark.timeout(60)
def test_signal_death_maps_to_128_plus_n():
    result, _ = run(specs(2, "kill", "0", str(int(signal.SIGSEGV))))
    assert result.failure.signal == signal.SIGSEGV and result.exit_code == 128 + signal.SIGSEGV
    assert "killed by SIGSEGV (exit code 139)" in result.failure.describe()


@pytest.mark.timeout(60)
def test_request_stop_forwards_signal():
    class StopWhenReady(Collect):
        def line(self, line):
            super().line(line)
            if sum(1 for _, _, l in self.lines if l.startswith(b"ready")) == 2:
                sup.request_stop(signal.SIGINT)  # as a signal handler would, mid-loop

    sup = Supervisor(specs(2, "exit", "9", "1"), StopWhenReady(), kill_grace=2.0, subreaper=False)
    result = sup.run()
    assert result.state is WorkerState.STOPPED and result.stop_signal == signal.SIGINT
    assert result.exit_code == 130
    # Python workers die of the forwarded SIGINT as KeyboardInterrupt (exit 1 or -2).
    assert set(result.states.values()) == {WorkerState.STOPPED}


@pytest.mark.timeout(60)
def test_unstartable_worker_fails_the_group():
    bad = [WorkerSpec(0, ["/nonexistent/prog"], dict(os.environ)), *specs(2, "ok")[1:]]
    result, sink = run(bad)
    assert result.failure.rank == 0 and result.exit_code == 127
    assert "cannot start '/nonexistent/prog'" in result.failure.stderr_tail[0]
    assert result.failure.how() == "cannot start '/nonexistent/prog': No such file or directory"


@pytest.mark.timeout(60)
def test_carriage_returns_end_lines_for_progress_bars():
    code = ("import sys, time\n"
            "for i in range(3):\n"
            "    sys.stderr.write(f'{i}/3\\r'); sys.stderr.flush(); time.sleep(0.05)\n"
            "sys.stderr.write('done\\r'); sys.stderr.flush(); time.sleep(0.05); sys.stderr.write('\\nwin\\r\\n')\n")
    result, sink = run([WorkerSpec(0, [sys.executable, "-c", code], dict(os.environ))])
    assert result.state is WorkerState.SUCCEEDED
    assert [l for _, _, l in sink.lines] == [b"0/3\r", b"1/3\r", b"2/3\r", b"done\r\n", b"win\r\n"]
