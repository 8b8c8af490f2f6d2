"""Suite-wide policy.

Under CI=true a skipped test is a failure, except tests marked `gpu`: CI has no GPU, but
it has everything else the suite needs (a compiler, sshd, network namespaces), so a skip
there would hide a missing piece instead of testing it.

Nothing the suite starts may outlive it: every process started from this one inherits a
session token in its environment, and a process still carrying it once the session is
over (every fixture torn down) fails the run, named with its command line, and is killed.
"""
import os
import signal
import sys
import time
import uuid

from kernel_paths import pin_environment

pin_environment()  # before torch loads: the CPU kernel paths DeepSpeed's fixtures were recorded on

import pytest  # noqa: E402  (after the pins above)

from cluster_fixture import ns_cluster, ssh_home  # noqa: F401  (the multi-host SSH test cluster, issue #3)
from hf_fixture import deepspeed_compat, tiny_gpt2  # noqa: F401  (the deepspeed compatibility package, issue #14)
from process_marks import Finder, item_starts_processes

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# No fixed ports: every dslaunch a test (or a script, a docs example, an autotuning trial) starts
# without --master_port rendezvouses on a free port, not on the default 29500 that any other job
# on the machine may hold or take between dslaunch's check and rank 0's bind. The tests of the
# default itself take the variable out of their environment.
PORT_VAR = "DSLAUNCH_MASTER_PORT"
os.environ.setdefault(PORT_VAR, "0")
SESSION_VAR = "DSLAUNCH_TEST_SESSION"
os.environ[SESSION_VAR] = SESSION = uuid.uuid4().hex
# multiprocessing's helper processes live as long as this process does, by design
_LONG_LIVED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


@pytest.fixture(scope="session", autouse=True)
def _children_use_the_sessions_temporary_folder(tmp_path_factory):
    """dslaunch and the workers the tests start make their temporary files and folders
    (e.g. the `dslaunch-run-*` folder that keeps hidden lines when there is no --log_dir)
    under this session's pytest folder, which pytest prunes, never loose in /tmp."""
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmpdir"))
    yield
    if old is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = old


@pytest.fixture(scope="session", autouse=True)
def _warm_rank_processes_end_with_the_session():
    """The warm interpreters dist_harness forks ranks from (tests/warm_ranks.py) live as long
    as the session, and end before its check for processes left behind."""
    yield
    import warm_ranks

    warm_ranks.stop_all()


@pytest.fixture(autouse=True)
def _no_process_group_outlives_its_test():
    """A test that calls initialize() in this process starts the single-process default group;
    it ends with the test, so a later test that expects none (fake groups, no rendezvous)
    sees the same process whatever ran before it."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from dist_harness import teardown

        teardown()


def pytest_collection_modifyitems(config, items):
    """`slow`: every test that starts processes (ranks, dslaunch, a compiler, a cluster), found
    from its code by process_marks.py. The default run still runs them all (CI does);
    `-m "not slow"` runs the rest, the in-process tests, in a fraction of the time."""
    finder = Finder()
    for item in items:
        if item.get_closest_marker("slow") is None and item_starts_processes(finder, item):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which must run this test: {reason}"


def _left_behind():
    """(pid, command line) of every process but this one that carries this session's token."""
    marker = f"{SESSION_VAR}={SESSION}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if marker not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile, or a zombie
        if cmd and not any(h in cmd for h in _LONG_LIVED_HELPERS):
            found.append((int(name), cmd))
    return found


def pytest_sessionfinish(session, exitstatus):
    """Every fixture is torn down by now: whatever still carries the token was orphaned.
    A few seconds' grace for processes already on their way out."""
    deadline = time.monotonic() + 10
    left = _left_behind()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _left_behind()
    if not left:
        return
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    message = f"{len(left)} process(es) started by the suite outlived it (killed now):\n{lines}"
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_line(message, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED

