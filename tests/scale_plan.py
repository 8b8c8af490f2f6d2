"""A generated cluster of n hosts and its --dry_run --json plan, for the planning-scale tests.

Deterministic: fixed machine facts, run id and port, so the plan of a given n is always the
same dict (tests/data/scale_plan_40.json holds the one planned before planning became linear).
"""
from __future__ import annotations

from typing import Any, Dict

from dslaunch.launcher.backends.ssh import SshBackend
from dslaunch.launcher.hostfile import parse_hostfile_text
from dslaunch.launcher.machine import MachineFacts
from dslaunch.launcher.options import LaunchOptions
from dslaunch.launcher.plan import build_plan
from dslaunch.launcher.plan_view import plan_to_dict


def hostfile_text(n: int) -> str:
    """Host 0 is this machine; every third host has a user; slots cycle 1..4."""
    lines = ["box0 slots=2"]
    for i in range(1, n):
        user = "alice@" if i % 3 == 0 else ""
        lines.append(f"{user}node{i:05d} slots={1 + i % 4}  # rack {i // 16}")
    return "\n".join(lines) + "\n"


def plan_dict(n: int, tmp_path) -> Dict[str, Any]:
    path = tmp_path / f"hosts{n}"
    path.write_text(hostfile_text(n))
    parse_hostfile_text(path.read_text())  # a generated file that does not parse is the test's bug
    facts = MachineFacts(0, None, 8, ("box0", "127.0.0.1"), python="/usr/bin/python3", cwd=str(tmp_path),
                         home=str(tmp_path))
    opts = LaunchOptions("train.py", ("--epochs", "1"), hostfile=str(path), exclude="node00002:0",
                         export=("WANDB_API_KEY=k",), master_port=29600, dry_run=True, json=True)
    (tmp_path / "train.py").write_text("")
    plan = build_plan(opts, facts, {"NCCL_DEBUG": "INFO", "HF_TOKEN": "t", "PATH": "/bin"}, run_id="r-scale",
                      master_addr_of=lambda target: target.rpartition("@")[2] + ".example")
    d = plan_to_dict(plan, SshBackend().describe(plan))
    # the temporary directory differs per run; everything else must not
    return _replace_text(d, str(tmp_path), "<tmp>")


def _replace_text(obj, old: str, new: str):
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, list):
        return [_replace_text(v, old, new) for v in obj]
    if isinstance(obj, dict):
        return {k: _replace_text(v, old, new) for k, v in obj.items()}
    return obj
