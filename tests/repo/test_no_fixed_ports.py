"""No test rendezvouses on a fixed port: another job on the machine may hold it, or take it
between dslaunch's check and rank 0's bind (EADDRINUSE). A launch that names no port gets a
free one in the test session (conftest sets DSLAUNCH_MASTER_PORT=0); a test that must name a
port takes one from the free-port helper (dist_harness.free_port); a literal port number next
to --master_port / MASTER_PORT / master_port= in the tests and in the scripts they run is an
error, except where no socket is ever opened on it (PLAN_ONLY) or it is not a usable port at all
(the usage-error tests)."""
import os
import re
from pathlib import Path
import repo_paths

ROOT = repo_paths.ROOT
PORT = re.compile(r"""(?:--master_port|--master-port|MASTER_PORT|master_port|main_process_port)["']?\s*(?:[=:,]|\s)\s*"""
                  r"""["']?(\d+)""")
# files whose port numbers only reach a plan or an environment, never a socket
PLAN_ONLY = {
    "tests/launcher/test_cluster.py": "plans and command lines for hosts of a hostfile; nothing runs",
    "tests/scale_plan.py": "a dry-run plan of 10,000 generated hosts",
    "scripts/bench_scale.py": "simulated hosts whose workers are `sh -c 'echo up'`",
    "tests/launcher/test_world.py": "the environment a worker would get",
}


def _numbers(path: Path):
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for m in PORT.finditer(line):
            yield n, int(m.group(1)), line.strip()


def test_the_session_launches_on_free_ports():
    assert os.environ.get("DSLAUNCH_MASTER_PORT") == "0" or "PYTEST_XDIST_WORKER" in os.environ


def test_no_literal_port_in_the_tests_or_the_scripts_they_run():
    found = []
    files = sorted([*ROOT.glob("tests/**/*.py"), *ROOT.glob("scripts/**/*.py"), *ROOT.glob("scripts/**/*.sh")])
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in PLAN_ONLY or rel == "tests/repo/test_no_fixed_ports.py":
            continue
        for n, port, line in _numbers(path):
            if port == 0 or port > 65535:  # 0: a free port; above 65535: a usage-error test's non-port
                continue
            found.append(f"{rel}:{n}: {line}")
    assert found == [], "\n".join(found)
