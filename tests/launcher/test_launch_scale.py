"""scripts/bench_scale.py's simulated cluster, small: the real head drives 16 real node agents
over the fake transport, every worker runs, and one frozen agent is found by the heartbeat.

The harness runs in a process of its own (it forks a zygote and the head installs signal
handlers). Its own checks make it fail when not every worker printed `up` or when the
failure the head declared is not the frozen host's silence; here the figures are checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import repo_paths

ROOT = str(repo_paths.ROOT)
SCRIPT = os.path.join(ROOT, "scripts", "bench_scale.py")
TIMEOUT = 3.0  # --heartbeat_timeout: pings every 0.6 s


def test_simulated_cluster_starts_and_detects_a_lost_node(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, SCRIPT, "--nodes", "16", "--heartbeat_timeout", str(TIMEOUT),
                           "--window", "1", "--json", str(out)], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())
    assert row["nodes"] == 16
    assert row["exit_code"] == 255  # a lost host ends the job with 255, as on a real cluster
    # silence is measured from the agent's last heartbeat (at most one interval before the
    # freeze) and checked every 0.25 s: named lost after timeout - interval, within timeout + slack
    assert TIMEOUT - row["heartbeat_interval_s"] - 0.1 <= row["detect_s"] <= TIMEOUT + 2.0, row
    assert row["heartbeat_bytes_per_s"] > 0 and row["start_s"] > 0 and row["teardown_s"] >= 0
    assert 0 <= row["head_return_s"] <= row["teardown_s"] and row["start_cpu_s"] > 0 and row["agents_start_cpu_s"] > 0
    # the attempt's start pool (at most one thread per link here) and a few of the head's own;
    # no thread per link: one reader for every socket, and the sockets take every ping at once
    # (no sender threads). One socket per link.
    assert row["head_threads"] <= 16 + 8 and row["head_fds"] <= 16 + 12, row
