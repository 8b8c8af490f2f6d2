"""Session fixture: the network-namespace SSH cluster of tests/testbed.py, built once.

Imported by tests/conftest.py so that every test file shares the one cluster. Building
needs root, sshd and iproute2 (scripts/setup_system.sh installs them); where it cannot be
built the tests skip with the reason, and conftest turns that skip into a failure under
CI=true.
"""
from __future__ import annotations

import pytest

import testbed

# Test sessions take a subnet among 10.213.20-119 (the benchmark uses 120-139): two sessions on
# one machine each get their own cluster instead of tearing down each other's.
FIRST_SUBNET, SUBNETS = 20, 100


@pytest.fixture(scope="session")
def ns_cluster(tmp_path_factory):
    try:
        tb = testbed.build_free("dt", FIRST_SUBNET, SUBNETS, 2, tmp_path_factory.mktemp("testbed"))
    except testbed.TestbedUnavailable as exc:
        pytest.skip(f"cannot build the SSH test cluster: {exc}")
    try:
        yield tb
    finally:
        tb.teardown()


@pytest.fixture
def ssh_home(ns_cluster, tmp_path):
    """(env, home): an environment whose ~/.ssh knows the cluster (config, key, known_hosts)."""
    home = tmp_path / "home"
    return ns_cluster.ssh_env(home), home
