"""Planning a thousand-node job: same plan as before, work linear in the number of hosts.

The plan of a generated 40-host cluster (a local host, users, mixed slot counts, an
--exclude, an exported secret) must equal, key for key, the one recorded before planning
was made linear (tests/data/scale_plan_40.json). Linearity is proven by counting Python
function calls, never by timing: planning 4x the hosts may cost about 4x the calls, where
the old code (a sum over every node per worker) cost 16x.
"""
from __future__ import annotations

import json
import sys

from scale_plan import plan_dict
import repo_paths

DATA = repo_paths.DATA / "scale_plan_40.json"


def test_generated_cluster_plan_is_unchanged(tmp_path):
    assert plan_dict(40, tmp_path) == json.loads(DATA.read_text())


def _calls(n: int, tmp_path) -> int:
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    d = tmp_path / str(n)
    d.mkdir()
    sys.setprofile(prof)
    try:
        plan = plan_dict(n, d)
    finally:
        sys.setprofile(None)
    assert plan["num_nodes"] == n
    return count


def test_planning_work_grows_linearly_with_hosts(tmp_path):
    small, large = _calls(100, tmp_path), _calls(400, tmp_path)
    assert large < 5 * small, (small, large)
