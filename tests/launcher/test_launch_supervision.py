"""Supervision through the CLI, proved with psutil: no process of the job survives a rank
crash, a rank killed by a signal, SIGINT, SIGTERM, or SIGKILL to the launcher, including
children that left the worker's process group and orphaned grandchildren."""
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import repo_paths
from dist_harness import DSLAUNCH

ROOT = repo_paths.ROOT
BEHAVE = str(repo_paths.WORKERS / "behave.py")


@pytest.fixture
def launched():
    """Launchers started by a test; a failing test must not leave its job running."""
    procs = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start(launched, tmp_path, mode, grace=1.0):
    pidfile = tmp_path / "pids"
    proc = subprocess.Popen(
        [*DSLAUNCH, "--num_gpus", "2", "--kill_grace", str(grace), "--master_port", "0", BEHAVE, "tree", str(pidfile), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
    )
    launched.append(proc)
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"pids.{r}").exists() for r in (0, 1)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.02)
    pids = {proc.pid}
    for r in (0, 1):
        pids.update(json.loads((tmp_path / f"pids.{r}").read_text()))
    pids.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))  # the watchdog too
    # dslaunch, 4 processes per rank, the watchdog: the workers hold still until "go", so the
    # tree is whole while it is counted (a rank that failed first ended the job mid-census)
    assert len(pids) >= 1 + 2 * 4 + 1, describe(pids)
    (tmp_path / "pids.go").write_text("")
    return proc, pids


def survivors(pids, within):
    deadline = time.monotonic() + within
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def describe(pids):
    out = []
    for pid in pids:
        try:
            out.append(" ".join(psutil.Process(pid).cmdline()))
        except psutil.Error:
            pass
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "mode, action, code, says",
    [
        ("exit:3", None, 3, "rank 1 failed first: exited with code 3"),
        ("signal:11", None, 139, "rank 1 failed first: killed by SIGSEGV (exit code 139)"),
        ("wait", signal.SIGINT, 130, "stopped by SIGINT; all 2 worker(s) ended"),
        ("wait", signal.SIGTERM, 143, "stopped by SIGTERM; all 2 worker(s) ended"),
        # The whole tree ignores SIGTERM: only the SIGKILL after --kill_grace ends it.
        ("ignore", None, 5, "rank 1 failed first: exited with code 5"),
    ],
)
def test_no_survivors(launched, tmp_path, mode, action, code, says):
    # A long grace period proves the SIGTERM sent at once ends every tree (no waiting for
    # SIGKILL), except where the tree ignores SIGTERM.
    proc, pids = start(launched, tmp_path, mode, grace=1.0 if mode == "ignore" else 20.0)
    t0 = time.monotonic()
    if action is not None:
        time.sleep(0.2)
        proc.send_signal(action)
    out, err = proc.communicate(timeout=30)
    elapsed = time.monotonic() - t0
    err = err.decode()
    assert proc.returncode == code, err
    assert f"dslaunch: {says}" in err
    if mode != "wait":
        # the failing rank's own output, then one summary (no repeated tail: it is right above)
        assert err.index("[rank 1] rank 1 is failing") < err.index(f"dslaunch: {says}")
        assert "dslaunch:   | rank 1 is failing" not in err
        assert "dslaunch: stopped the other 1 of 2 worker(s)" in err
    if mode == "ignore":
        assert elapsed >= 1.0  # waited the grace period before SIGKILL
    else:
        assert elapsed < 10.0
    assert survivors(pids, within=5) == [], describe(pids)


@pytest.mark.timeout(90)
def test_sigkill_to_launcher_leaves_no_orphans(launched, tmp_path):
    proc, pids = start(launched, tmp_path, "wait", grace=1.0)
    proc.kill()
    proc.wait()
    left = survivors(pids - {proc.pid}, within=8)
    assert left == [], describe(left)


@pytest.mark.timeout(90)
def test_second_sigint_kills_at_once(launched, tmp_path):
    """Workers that ignore SIGINT and SIGTERM: the second Ctrl-C does not wait out a 20 s grace."""
    proc, pids = start(launched, tmp_path, "ignore_wait", grace=20.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # still inside the grace period
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 10
    assert "dslaunch: received SIGINT: stopping the workers (again to kill them at once" in err.decode()
    assert survivors(pids, within=5) == [], describe(pids)


# A worker whose child leaves its session and drops its environment (no job marker for the
# watchdog to find it by), then waits.
ESCAPER = """
import os, subprocess, sys, time
child = subprocess.Popen(["setsid", "env", "-i", "sleep", "120"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def kill(pids):
    """A failed test leaves nothing running (what it describes is already gone)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return []


def start_escaper(launched, tmp_path):
    script = tmp_path / "escaper.py"
    script.write_text(ESCAPER)
    pidfile = tmp_path / "grandchild"
    proc = subprocess.Popen([*DSLAUNCH, "--kill_grace", "1", "--master_port", "0", "--no_local_rank", str(script),
                             str(pidfile)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    launched.append(proc)
    deadline = time.monotonic() + 30
    while not pidfile.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the worker did not start its child"
        time.sleep(0.02)
    grandchild = psutil.Process(int(pidfile.read_text()))
    while grandchild.cmdline() != ["sleep", "120"]:  # setsid and env exec it in the same process
        assert time.monotonic() < deadline, grandchild.cmdline()
        time.sleep(0.02)
    assert grandchild.environ() == {}  # no job marker for the watchdog to find it by
    grandchild = grandchild.pid
    return proc, {grandchild, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}


@pytest.mark.timeout(90)
def test_sigkill_to_launcher_ends_a_grandchild_that_left_with_setsid_and_no_environment(launched, tmp_path):
    proc, pids = start_escaper(launched, tmp_path)
    proc.kill()
    proc.wait()
    left = survivors(pids, within=10)
    assert left == [], describe(left) + kill(left)


@pytest.mark.timeout(90)
def test_sigkill_to_the_job_process_leaves_nothing_and_is_named(launched, tmp_path):
    """The launcher's own pid is the keeper; the process that supervises the workers is its
    one child. A SIGKILL of that one: the keeper ends what it left and says so."""
    proc, pids = start_escaper(launched, tmp_path)
    job = psutil.Process(proc.pid).children()
    assert len(job) == 1
    job[0].kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 137, err
    assert f"dslaunch: the job process {job[0].pid} was killed by SIGKILL; ended the" in err.decode()
    left = survivors(pids, within=5)
    assert left == [], describe(left) + kill(left)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runtime", [False, True], ids=["plain", "runtime"])
def test_ctrl_c_is_the_launchers_lines_not_a_traceback_per_rank(launched, tmp_path, runtime):
    """SIGINT reaches every rank through the launcher: each raises KeyboardInterrupt. The
    console shows the launcher's lines only (a script using dslaunch.runtime prints no
    traceback at all; a plain one's is kept in its log file)."""
    script = tmp_path / "wait.py"
    script.write_text(("import dslaunch.runtime\n" if runtime else "") +
                      "import time\nprint('ready', flush=True)\ntime.sleep(100)\n")
    proc = subprocess.Popen([*DSLAUNCH, "--num_gpus", "2", "--master_port", "0", "--log_dir", str(tmp_path / "logs"),
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    launched.append(proc)
    logs = [tmp_path / "logs" / f"rank_{r}.log" for r in (0, 1)]
    deadline = time.monotonic() + 90
    while not all(p.exists() and "ready" in p.read_text() for p in logs):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert [line for line in err.splitlines() if "GPU" not in line] == [
        "dslaunch: received SIGINT: stopping the workers (again to kill them at once, else SIGKILL after 5s)",
        "dslaunch: stopped by SIGINT; all 2 worker(s) ended"]
    kept = [p.read_text() for p in logs]
    if runtime:
        assert all("Traceback" not in k for k in kept), kept
    else:
        assert all(k.rstrip().endswith("KeyboardInterrupt") for k in kept), kept
