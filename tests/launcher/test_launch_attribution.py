"""The rank whose exception started a failure is the one named, with its traceback on the
console, even when a peer that waited in a collective for it fails and exits first: the
runtime's excepthook tells the supervisor (supervisor.py, "Which worker failed first")."""
import os
import subprocess
from pathlib import Path

import pytest
import repo_paths
from dist_harness import DSLAUNCH

WORKER = str(repo_paths.WORKERS / "raise_in_collective.py")
REPEAT = int(os.environ.get("DSLAUNCH_ATTRIBUTION_REPEAT", "2"))


def run_case(case: str, cwd: Path) -> subprocess.CompletedProcess:
    cwd.mkdir(exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(cwd))  # the summary's dslaunch-run-* folder too
    return subprocess.run([*DSLAUNCH, "--num_gpus", "2", "--master_port", "0", WORKER, case, str(cwd)],
                          capture_output=True, text=True, cwd=cwd, timeout=170, env=env)


def attributed_to_rank_0(r: subprocess.CompletedProcess) -> bool:
    """rank 0 named, its traceback shown, nothing of rank 1's follow-on error on the console."""
    return (r.returncode == 1 and "dslaunch: rank 0 failed first: exited with code 1" in r.stderr
            and "[rank 0] RuntimeError: rank 0 broke on purpose" in r.stderr
            and "[rank 0] Traceback (most recent call last):" in r.stderr
            and "Connection closed by peer" not in r.stderr and "[rank 1]" not in r.stderr)


def test_the_rank_that_raised_is_named_though_its_peer_exits_first(tmp_path):
    r = run_case("slow_exit", tmp_path)
    assert attributed_to_rank_0(r), r.stderr
    assert "dslaunch: rank 1: stopped after rank 0 failed; 3 line(s) not shown" in r.stderr


@pytest.mark.timeout(180 * REPEAT)
@pytest.mark.parametrize("case", ["zero0", "zero1", "zero2", "zero3", "pipe"])
def test_rank_0_raises_while_rank_1_waits_in_a_collective(tmp_path, case):
    for i in range(REPEAT):
        r = run_case(case, tmp_path)
        assert attributed_to_rank_0(r), f"run {i + 1} of {REPEAT}:\n{r.stderr}"


def test_a_rank_killed_during_a_save_is_named_though_its_peer_announced_an_exception(tmp_path):
    """rank 0 is SIGKILLed while it writes a checkpoint; rank 1 fails in the save's collectives
    and its runtime announces the exception, which the supervisor reads in the same instant
    as rank 0's death (the worker arranges that). The death came first, and is what is named."""
    r = run_case("kill_in_save", tmp_path / "ckpt")
    assert r.returncode == 137, r.stderr
    assert "dslaunch: rank 0 failed first: killed by SIGKILL (exit code 137)" in r.stderr
    assert "rank 1 failed first" not in r.stderr and "[rank 1]" not in r.stderr
    assert "dslaunch: rank 1: stopped after rank 0 failed" in r.stderr


def test_the_runtime_and_the_supervisor_agree_on_the_pipe_variable():
    from dslaunch.launcher.supervisor import ORIGIN_FD_VAR
    from dslaunch.runtime.comm.shutdown import ORIGIN_FD_VAR as runtime_var

    assert ORIGIN_FD_VAR == runtime_var
