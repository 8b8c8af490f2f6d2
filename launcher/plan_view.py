"""--dry_run: the plan as text or JSON, with secret values masked in both forms.

One view for every layout: this machine only, other hosts through an agent backend, or a
tool that starts the ranks itself (the backend's describe() adds its command). Values are
shown through masking.masked(), so what --dry_run prints is what a screenshot may hold.
"""
from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional

from dslaunch.launcher.hostfile import join_user
from dslaunch.launcher.masking import MASK, masked
from dslaunch.launcher.plan import LaunchPlan


def _ranges(values: List[int]) -> str:
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def plan_to_dict(plan: LaunchPlan, backend: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    show = plan.options.show_env
    d: Dict[str, Any] = {
        "run_id": plan.run_id,
        "world_size": plan.world.world_size,
        "num_nodes": plan.world.num_nodes,
        "master_addr": plan.master_addr,
        "master_port": plan.master_port,
        "env_files": plan.env_files.paths,
        "max_restarts": plan.options.max_restarts,
        "log_dir": plan.options.log_dir,
        "notes": list(plan.notes),
        "launcher": plan.options.launcher if plan.remote_nodes else None,
        "nodes": [
            {
                "node_rank": n.node.node_rank,
                "host": n.node.host,
                "user": n.node.user,
                "local": n.local,
                "accelerator": n.workers[0].env.get("DSLAUNCH_ACCELERATOR") if n.finished else None,
                "slots": list(n.node.slots),
                "ranks": list(n.node.ranks),
                "workers": [
                    {"rank": w.rank, "local_rank": w.local_rank, "argv": list(w.argv),
                     "env": masked(w.env, plan.hidden, show), "cpus": None if w.cpus is None else list(w.cpus)}
                    for w in n.workers
                ],
            }
            for n in plan.nodes
        ],
    }
    if plan.elastic is not None:  # only then: the plans of fixed-size jobs keep their keys
        d["elastic"] = {"min_nodes": plan.elastic.min_nodes, "max_nodes": plan.elastic.max_nodes,
                        "checkpoint_dir": plan.options.checkpoint_dir,
                        "checkpoint_every": plan.options.checkpoint_every}
    if backend is not None:
        d["backend"] = backend
    return d


def format_plan(plan: LaunchPlan, backend: Optional[Dict[str, Any]] = None) -> str:
    d = plan_to_dict(plan, backend)
    port = d["master_port"] or "a free port"
    head = (f"dslaunch plan: {d['num_nodes']} node(s), world size {d['world_size']}, "
            f"master {d['master_addr']}:{port}, run id {d['run_id']}, max restarts {d['max_restarts']}")
    if d.get("elastic"):
        head += f", elastic {d['elastic']['min_nodes']}-{d['elastic']['max_nodes']} hosts"
    out = [head + (f", launcher {d['launcher']}" if d["launcher"] else "")]
    out += [f"env file: {p}" for p in d["env_files"]]
    agents = (backend or {}).get("agents", {})
    for n in d["nodes"]:
        who = join_user(n["user"], n["host"])
        where = f"this machine, {n['accelerator']}" if n["local"] else "remote"
        out.append(f"node {n['node_rank']}: {who} ({where}) slots {_ranges(n['slots'])} "
                   f"ranks {n['ranks'][0]}-{n['ranks'][-1]}")
        if who in agents:
            out.append(f"  agent: {agents[who]}")
        for w in n["workers"]:
            out.append(f"  rank {w['rank']} (local {w['local_rank']}): {shlex.join(w['argv'])}")
            out.append("    env: " + " ".join(f"{k}={v if v == MASK else shlex.quote(v)}"
                                          for k, v in sorted(w["env"].items())))
            if w["cpus"] is not None:
                out.append(f"    cpus: {_ranges(w['cpus'])}")
    if backend and "command" in backend:
        env = backend.get("env", {})
        line = " ".join(f"{k}={v if v == MASK else shlex.quote(v)}" for k, v in sorted(env.items()))
        out.append(f"command: {(line + ' ') if line else ''}{shlex.join(backend['command'])}")
    return "\n".join(out)
