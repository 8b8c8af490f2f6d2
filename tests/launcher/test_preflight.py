"""`dslaunch check --hostfile H` against the namespace cluster."""
import os
import re
import subprocess
import sys

import pytest

from dist_harness import DSLAUNCH


@pytest.mark.timeout(120)
def test_check_prints_table_and_names_offending_hosts(ns_cluster, ssh_home, tmp_path):
    from dist_harness import free_port

    env, home = ssh_home
    h1, h2 = ns_cluster.hosts
    port = str(free_port())  # free here; the cluster's hosts have network namespaces of their own
    good = tmp_path / "good"
    good.write_text(f"{h1.name} slots=2\nroot@{h2.ip} slots=2\n")
    res = subprocess.run(DSLAUNCH + ["check", "--hostfile", str(good), "--master_port", port],
                         env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split()[:7] == ["host", "reachable", "ssh", "ms", "python", "torch", "gpus/slots"]
    assert f"master {h1.ip}:{port}" in lines[0]  # default master: the first host, as SSH resolves it
    py = ".".join(map(str, sys.version_info[:3]))
    from importlib.metadata import version
    for row, name in zip(lines[1:], [h1.name, f"root@{h2.ip}"]):
        cols = row.split()
        assert cols[0] == name and cols[1] == "yes" and float(cols[2]) > 0
        assert cols[3] == py and cols[4] == version("torch")
        assert "0/2 (cpu)" in row and row.rstrip().endswith("ok")

    bad = tmp_path / "bad"
    bad.write_text(f"{h1.name} slots=2\n{ns_cluster.unused_ip} slots=1\n")
    res = subprocess.run(DSLAUNCH + ["check", "--hostfile", str(bad), "--ssh_timeout", "1",
                                     "--master_addr", f"{ns_cluster.subnet}.97", "--master_port", port],
                         env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 1
    rows = {r.split()[0]: r for r in res.stdout.splitlines()[1:]}
    assert f"FAIL: master {ns_cluster.subnet}.97:{port} " in rows[h1.name]
    assert rows[ns_cluster.unused_ip].split()[1] == "NO"
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dslaunch check: preflight failed on ")
    # the first try times out; after it the kernel may remember the failed ARP and say so at once
    assert h1.name in err[0] and re.search(rf"{re.escape(ns_cluster.unused_ip)} \((connect to .* timed out|"
                                           r"cannot connect to .*No route to host)", err[0]), err[0]


def test_check_of_this_machine_needs_no_ssh_and_reads_the_launch_variables(tmp_path):
    """localhost only: probed here (no SSH to localhost:22); DSLAUNCH_* options as for a launch."""
    from dist_harness import free_port

    hf = tmp_path / "hosts"
    hf.write_text("localhost slots=2\n")
    port = str(free_port())
    env = dict(os.environ, DSLAUNCH_HOSTFILE=str(hf), DSLAUNCH_MASTER_PORT=port, DSLAUNCH_SSH_TIMEOUT="nan",
               HOME=str(tmp_path))
    res = subprocess.run(DSLAUNCH + ["check"], env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 2 and res.stderr.strip() == "dslaunch check: --ssh_timeout nan: must be a finite number of seconds"
    del env["DSLAUNCH_SSH_TIMEOUT"]
    res = subprocess.run(DSLAUNCH + ["check"], env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    header, row = res.stdout.splitlines()
    assert f"master 127.0.0.1:{port}" in header  # a free port: refused, which proves the address
    assert row.split()[:2] == ["localhost", "yes"] and "0/2 (cpu)" in row and row.rstrip().endswith("ok")


def test_check_usage_errors_are_one_line(tmp_path):
    res = subprocess.run(DSLAUNCH + ["check", "--hostfile", str(tmp_path / "nope")], capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.strip() == f"dslaunch check: {tmp_path / 'nope'}: hostfile not found"
