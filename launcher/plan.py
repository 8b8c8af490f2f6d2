"""From resolved options and machine facts to a launch plan: pure, so --dry_run can show it.

LaunchOptions mirrors the CLI one field per option (cli.py builds it with
LaunchOptions(**params)), so adding an option means adding a field here and a
decorator there. The plan holds everything a run needs except the restart count, which
changes per attempt: worker_specs_env() builds the env for any attempt.
"""
from __future__ import annotations

import secrets
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from dslaunch.launcher.envfile import EnvFile, load_env_file
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import HostSpec, parse_hostfile
from dslaunch.launcher.machine import MachineFacts, is_local
from dslaunch.launcher.world import Node, RunIdentity, World, layout_world, worker_argv, worker_env

DEFAULT_MASTER_PORT = 29500


@dataclass
class LaunchOptions:
    """Every option of `dslaunch`, resolved (command line over DSLAUNCH_* over default)."""

    script: str
    script_args: Tuple[str, ...] = ()
    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None
    hostfile: Optional[str] = None
    include: str = ""
    exclude: str = ""
    master_addr: Optional[str] = None
    master_port: int = DEFAULT_MASTER_PORT
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    log_dir: Optional[str] = None
    max_restarts: int = 0
    kill_grace: float = 5.0
    env_file: Optional[str] = None
    dry_run: bool = False
    json: bool = False

    def __post_init__(self):
        self.script_args = tuple(self.script_args)
        if self.max_restarts < 0:
            raise LaunchConfigError(f"--max_restarts {self.max_restarts}: must be 0 or more")
        if self.kill_grace < 0:
            raise LaunchConfigError(f"--kill_grace {self.kill_grace}: must be 0 or more")
        if not 0 <= self.master_port <= 65535:
            raise LaunchConfigError(f"--master_port {self.master_port}: not a TCP port (0 picks a free one)")
        if self.json and not self.dry_run:
            raise LaunchConfigError("--json only applies to --dry_run")
        if self.module and self.no_python:
            raise LaunchConfigError("--module and --no_python cannot be used together")


@dataclass
class NodePlan:
    node: Node
    local: bool  # this machine: run here; otherwise the multi-node hand-off runs it
    accelerator: Optional[str]  # "cuda"/"cpu" for local nodes; None: decided on that host
    omp_threads: Optional[int]
    argvs: List[List[str]]  # per local rank


@dataclass
class LaunchPlan:
    options: LaunchOptions
    world: World
    nodes: List[NodePlan]
    master_addr: str
    master_port: int
    run_id: str
    env_file: EnvFile
    visible_devices: Optional[List[str]]
    notes: List[str] = field(default_factory=list)  # said once on stderr (e.g. the CPU-mode note)

    @property
    def remote_nodes(self) -> List[NodePlan]:
        return [n for n in self.nodes if not n.local]

    def identity(self, restart_count: int = 0) -> RunIdentity:
        return RunIdentity(self.master_addr, self.master_port, self.run_id, restart_count, self.options.max_restarts)

    def worker_env(self, node: NodePlan, local_rank: int, restart_count: int = 0) -> Dict[str, str]:
        """What the launcher adds to a worker's inherited environment: .dslaunch_env, then the contract."""
        env = dict(self.env_file.values)
        contract = worker_env(self.world, node.node, local_rank, self.identity(restart_count),
                              accelerator=node.accelerator or "cuda", omp_threads=node.omp_threads,
                              visible_devices=self.visible_devices if node.local else None)
        if node.accelerator is None:
            del contract["DSLAUNCH_ACCELERATOR"]
        env.update(contract)
        return env


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def resolve_hosts(opts: LaunchOptions, facts: MachineFacts) -> List[HostSpec]:
    """The host pool: the hostfile's, or this machine with its GPUs (or worker processes)."""
    if opts.hostfile:
        return parse_hostfile(opts.hostfile)
    if opts.num_nodes not in (None, 1):
        raise LaunchConfigError(f"--num_nodes {opts.num_nodes} needs a --hostfile listing the nodes")
    if opts.num_gpus is not None:
        if opts.num_gpus < 1:
            raise LaunchConfigError(f"--num_gpus {opts.num_gpus}: must be at least 1")
        if facts.gpu_count and opts.num_gpus > facts.gpu_count:
            raise LaunchConfigError(f"--num_gpus {opts.num_gpus}: only {facts.gpu_count} GPU(s) visible on this machine")
        slots = opts.num_gpus
    else:
        slots = facts.gpu_count or 1
    return [HostSpec("localhost", None, slots, "<this machine>")]


def build_plan(opts: LaunchOptions, facts: MachineFacts, environ: Mapping[str, str],
               run_id: Optional[str] = None) -> LaunchPlan:
    hosts = resolve_hosts(opts, facts)
    # Without a hostfile --num_gpus already sized the pool; with one it picks slots per host.
    world = layout_world(hosts, include=opts.include, exclude=opts.exclude,
                         num_nodes=opts.num_nodes if opts.hostfile else None,
                         num_gpus=opts.num_gpus if opts.hostfile else None)
    env_file = load_env_file(opts.env_file, Path(facts.cwd), Path(facts.home))
    notes: List[str] = []
    nodes: List[NodePlan] = []
    for node in world.nodes:
        local = is_local(node.host, facts.hostnames)
        accelerator = omp = None
        if local:
            accelerator = "cuda" if facts.gpu_count else "cpu"
            if facts.gpu_count and max(node.slots) >= facts.gpu_count:
                source = next(h.source for h in hosts if h.host == node.host)
                raise LaunchConfigError(
                    f"{source}: {node.host} would use GPU slot {max(node.slots)} but this machine has "
                    f"{facts.gpu_count} GPU(s) visible")
            if "OMP_NUM_THREADS" not in environ and "OMP_NUM_THREADS" not in env_file.values:
                # torchrun sets 1; an even share of the cores is as safe against oversubscription and faster.
                omp = max(1, facts.cpu_count // node.local_world_size)
        argvs = [worker_argv(opts.script, opts.script_args, lr, python=facts.python, module=opts.module,
                             no_python=opts.no_python, no_local_rank=opts.no_local_rank)
                 for lr in range(node.local_world_size)]
        nodes.append(NodePlan(node, local, accelerator, omp, argvs))
    if any(n.local for n in nodes) and not facts.gpu_count:
        n = sum(p.node.local_world_size for p in nodes if p.local)
        notes.append(f"no GPU on this machine: --num_gpus counts worker processes; running {n} on the CPU")
    all_local = all(n.local for n in nodes)
    master_addr = opts.master_addr or ("127.0.0.1" if all_local else world.nodes[0].host)
    master_port = opts.master_port
    if any(n.local for n in nodes) and not opts.module:
        _check_script(opts, facts)
    return LaunchPlan(opts, world, nodes, master_addr, master_port, run_id or new_run_id(), env_file,
                      facts.visible_devices, notes)


def _check_script(opts: LaunchOptions, facts: MachineFacts) -> None:
    import shutil

    path = Path(facts.cwd, opts.script)
    if opts.no_python:
        if "/" in opts.script:
            if not path.is_file():
                raise LaunchConfigError(f"{opts.script}: no such program")
        elif shutil.which(opts.script) is None:
            raise LaunchConfigError(f"{opts.script}: program not found on PATH")
    elif not path.is_file():
        raise LaunchConfigError(f"{opts.script}: no such script")


def plan_to_dict(plan: LaunchPlan) -> Dict[str, Any]:
    return {
        "run_id": plan.run_id,
        "world_size": plan.world.world_size,
        "num_nodes": plan.world.num_nodes,
        "master_addr": plan.master_addr,
        "master_port": plan.master_port,
        "env_file": plan.env_file.path,
        "max_restarts": plan.options.max_restarts,
        "log_dir": plan.options.log_dir,
        "notes": plan.notes,
        "nodes": [
            {
                "node_rank": n.node.node_rank,
                "host": n.node.host,
                "user": n.node.user,
                "local": n.local,
                "accelerator": n.accelerator,
                "slots": list(n.node.slots),
                "ranks": list(n.node.ranks),
                "workers": [
                    {"rank": n.node.first_rank + lr, "local_rank": lr, "argv": argv, "env": plan.worker_env(n, lr)}
                    for lr, argv in enumerate(n.argvs)
                ],
            }
            for n in plan.nodes
        ],
    }


def format_plan(plan: LaunchPlan) -> str:
    d = plan_to_dict(plan)
    port = d["master_port"] or "a free port"
    out = [f"dslaunch plan: {d['num_nodes']} node(s), world size {d['world_size']}, "
           f"master {d['master_addr']}:{port}, run id {d['run_id']}, max restarts {d['max_restarts']}"]
    if d["env_file"]:
        out.append(f"env file: {d['env_file']}")
    for n in d["nodes"]:
        where = "this machine" if n["local"] else "remote"
        who = f"{n['user']}@{n['host']}" if n["user"] else n["host"]
        acc = f", {n['accelerator']}" if n["accelerator"] else ""
        out.append(f"node {n['node_rank']}: {who} ({where}{acc}) slots {','.join(map(str, n['slots']))} "
                   f"ranks {n['ranks'][0]}-{n['ranks'][-1]}")
        for w in n["workers"]:
            out.append(f"  rank {w['rank']} (local {w['local_rank']}): {shlex.join(w['argv'])}")
            out.append("    env: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in w["env"].items()))
    return "\n".join(out)
