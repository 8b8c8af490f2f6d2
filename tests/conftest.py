"""Suite-wide policy.

Under CI=true a skipped test is a failure, except tests marked `gpu`: CI has no GPU, but
it has everything else the suite needs (a compiler, sshd, network namespaces), so a skip
there would hide a missing piece instead of testing it.
"""
import os

import pytest

from cluster_fixture import ns_cluster, ssh_home  # noqa: F401  (the multi-host SSH test cluster, issue #3)
from hf_fixture import deepspeed_compat, tiny_gpt2  # noqa: F401  (the deepspeed compatibility package, issue #14)

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("gpu") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which must run this test: {reason}"
