"""From resolved options and machine facts to the launch plan: pure, so --dry_run can show it.

The plan is the only place a worker's argv and environment are computed, for every node:
the local supervisor runs its workers as they are, and a backend (ssh, pdsh, mpirun, srun)
only transports a node's part to its host. What only the host itself can know (its
accelerator, its core count for OMP_NUM_THREADS and --bind_cores_to_rank) is filled in by
finish_workers(), here for this machine and by the node agent for other hosts: one
function either way.

A worker's env is what the launcher sets on top of the environment the worker inherits:
the env files, --export values, for other hosts the forwarded variables, then the
contract (world.worker_env), which wins over all of them (a stray RANK in an env file must
not break the job). The restart count is the only value that changes per attempt
(WorkerPlan.env_for).
"""
from __future__ import annotations

import re
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher import elastic as elastic_contract
from dslaunch.launcher.cores import cores_for_rank, node_core_pool
from dslaunch.launcher.elastic import ElasticSpec
from dslaunch.launcher.envfile import EnvFiles, load_env_files
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import HostSpec, parse_hostfile
from dslaunch.launcher.machine import MachineFacts, is_local
from dslaunch.launcher.options import DEFAULT_MASTER_PORT, LaunchOptions
from dslaunch.launcher.world import (Node, RunIdentity, World, check_selection, layout_world, worker_argv,
                                     worker_env)

# Variables of the launcher's environment that other hosts' workers get too (DeepSpeed
# forwards NCCL PYTHON MV2 UCX; torchrun's users expect TORCH_ and OMP_ to travel as well).
FORWARD_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "CUDA_", "TORCH_", "OMP_", "UCX_", "FI_", "HF_")
RESTART_VARS = ("DSLAUNCH_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    local_rank: int
    argv: Tuple[str, ...]
    env: Dict[str, str]  # set on top of the inherited environment; restart count 0
    cpus: Optional[Tuple[int, ...]] = None  # --bind_cores_to_rank: the only cores it may run on

    def env_for(self, restart: int) -> Dict[str, str]:
        env = dict(self.env)
        for name in RESTART_VARS:
            env[name] = str(restart)
        return env

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["argv"] = list(self.argv)
        d["cpus"] = None if self.cpus is None else list(self.cpus)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WorkerPlan":
        cpus = d.get("cpus")
        return cls(int(d["rank"]), int(d["local_rank"]), tuple(str(a) for a in d["argv"]),
                   {str(k): str(v) for k, v in dict(d["env"]).items()}, None if cpus is None else tuple(cpus))


@dataclass(frozen=True)
class NodePlan:
    node: Node
    local: bool  # runs on this machine with no transport; otherwise a backend carries it
    workers: Tuple[WorkerPlan, ...]
    finished: bool  # host facts applied (this machine); False: the node's agent applies them
    bind_core_list: Optional[str] = None  # None: no binding; "": all usable cores of the host

    @property
    def target(self) -> str:
        return self.node.target


@dataclass
class LaunchPlan:
    options: LaunchOptions
    world: World
    nodes: Tuple[NodePlan, ...]
    master_addr: str
    master_port: int
    run_id: str
    env_files: EnvFiles
    hidden: FrozenSet[str]  # names whose values are hidden by origin (env files, --export VALUE)
    remote_python: str
    workdir: str
    notes: List[str] = field(default_factory=list)  # said once on stderr before the launch
    elastic: Optional[ElasticSpec] = None  # an elastic job's host-count bounds (elastic.py)
    # elastic jobs, set by launch.py: the plan on other hosts (targets), and the pool as the
    # hostfile lists it now ((target, slots) in hostfile order, read again each call)
    replan: Optional[Callable[[Sequence[str]], "LaunchPlan"]] = field(default=None, repr=False, compare=False)
    hosts_now: Optional[Callable[[], List[Tuple[str, int]]]] = field(default=None, repr=False, compare=False)

    @property
    def remote_nodes(self) -> List[NodePlan]:
        return [n for n in self.nodes if not n.local]

    def identity(self, restart_count: int = 0) -> RunIdentity:
        return RunIdentity(self.master_addr, self.master_port, self.run_id, restart_count, self.options.max_restarts)


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def uses_allocation(opts: LaunchOptions, environ: Mapping[str, str]) -> bool:
    """`--launcher slurm` without --hostfile inside a Slurm allocation: its nodes are the hosts."""
    from dslaunch.launcher.allocation import in_allocation

    return opts.launcher == "slurm" and not opts.hostfile and in_allocation(environ)


def resolve_hosts(opts: LaunchOptions, facts: MachineFacts,
                  environ: Optional[Mapping[str, str]] = None) -> List[HostSpec]:
    """The host pool: the hostfile's, the Slurm allocation's, or this machine with its GPUs
    (or worker processes)."""
    if opts.hostfile:
        return parse_hostfile(opts.hostfile)
    if environ is not None and uses_allocation(opts, environ):
        from dslaunch.launcher.allocation import allocation_hosts

        return allocation_hosts(environ)
    if opts.num_nodes not in (None, 1):
        raise LaunchConfigError(f"--num_nodes {opts.num_nodes} needs a --hostfile listing the nodes")
    if opts.num_gpus is not None:
        if facts.gpu_count and opts.num_gpus > facts.gpu_count:
            raise LaunchConfigError(f"--num_gpus {opts.num_gpus}: only {facts.gpu_count} GPU(s) visible on this machine")
        slots = opts.num_gpus
    else:
        slots = facts.gpu_count or 1
    return [HostSpec("localhost", None, slots, "<this machine>")]


def passed_env(opts: LaunchOptions, environ: Mapping[str, str], env_files: EnvFiles,
               remote: bool) -> Tuple[Dict[str, str], FrozenSet[str]]:
    """What the launcher adds below the contract, and the names hidden by origin.

    Local workers inherit the launcher's environment, so they get the env files and
    --export values; other hosts' workers also get the FORWARD_PREFIXES variables and
    every bare `--export NAME`.
    """
    out: Dict[str, str] = dict(env_files.values)
    hidden = set(out)
    if remote:
        for name, value in environ.items():
            if name.startswith(FORWARD_PREFIXES):
                out[name] = value
        out.pop("CUDA_VISIBLE_DEVICES", None)  # describes this machine's devices, not the remote node's
    for item in opts.export:
        name, eq, value = item.partition("=")
        if not _NAME_RE.match(name):
            raise LaunchConfigError(f"--export {item!r}: {name!r} is not a valid variable name")
        if "\0" in value:
            raise LaunchConfigError(f"--export {name}: the value contains a NUL byte")
        if eq:
            out[name] = value
            hidden.add(name)
        elif name in environ:
            if remote:
                out[name] = environ[name]
        else:
            raise LaunchConfigError(f"--export {name}: not set in the launcher's environment")
    return out, frozenset(hidden)


def finish_workers(workers: Sequence[WorkerPlan], *, accelerator: str, cpu_count: int,
                   inherited: Mapping[str, str], bind_core_list: Optional[str],
                   core_pool: Callable[[Optional[str]], List[int]] = node_core_pool) -> Tuple[WorkerPlan, ...]:
    """Apply what only the worker's host knows: its accelerator, OMP_NUM_THREADS and the
    --bind_cores_to_rank core sets. Used for this machine by build_plan and for other hosts
    by the node agent."""
    n = len(workers)
    cores = core_pool(bind_core_list or None) if bind_core_list is not None else None
    out = []
    for w in workers:
        env = dict(w.env)
        env["DSLAUNCH_ACCELERATOR"] = accelerator
        cpus = None
        if cores is not None:
            cpus = cores_for_rank(cores, n, w.local_rank)
            env["OMP_NUM_THREADS"] = str(len(cpus))  # one thread per pinned core, as DeepSpeed does
        elif "OMP_NUM_THREADS" not in inherited and "OMP_NUM_THREADS" not in env:
            # torchrun sets 1; an even share of the cores is as safe against oversubscription and faster
            env["OMP_NUM_THREADS"] = str(max(1, cpu_count // n))
        out.append(replace(w, env=env, cpus=cpus))
    return tuple(out)


def build_plan(opts: LaunchOptions, facts: MachineFacts, environ: Mapping[str, str], *,
               run_id: Optional[str] = None, pick_port: Optional[Callable[[str], int]] = None,
               master_addr_of: Optional[Callable[[str], str]] = None,
               port_in_use: Optional[Callable[[str, int], bool]] = None,
               only_hosts: Optional[Sequence[str]] = None, base_world: Optional[int] = None) -> LaunchPlan:
    """pick_port(addr) serves --master_port 0 on this machine; master_addr_of(target) gives
    the first host's address as the transport resolves it (~/.ssh/config HostName);
    port_in_use(addr, port) checks a one-machine job's port before any worker starts.

    The port, on one machine: an explicit --master_port that is taken is a usage error
    (one line, before anything starts, instead of every worker's EADDRINUSE traceback);
    the default 29500 taken (another job here) moves to a free port, and a note says which,
    as torchrun --standalone would pick one. Across machines nothing is checked: the
    master's port is only known free on the master.

    An elastic job (--min_nodes/--max_nodes) is planned on the first --max_nodes hosts;
    re-planned, on `only_hosts` (host names), keeping `base_world`, the size its global
    batch is configured for (the first plan's world size)."""
    # before --num_gpus sizes this machine's pool, so the rule holds with or without a hostfile
    check_selection(opts.include, opts.exclude, opts.num_nodes, opts.num_gpus)
    hosts = resolve_hosts(opts, facts, environ)
    # Without a host list --num_gpus already sized the pool; with one it picks slots per host.
    listed = bool(opts.hostfile) or uses_allocation(opts, environ)
    spec = None
    if opts.elastic:
        pool = layout_world(hosts, include=opts.include, exclude=opts.exclude,
                            num_gpus=opts.num_gpus if listed else None)
        spec = elastic_contract.resolve_spec(opts.min_nodes, opts.max_nodes, pool.num_nodes, opts.num_nodes)
        max_world = sum(sorted((n.local_world_size for n in pool.nodes), reverse=True)[:spec.max_nodes])
    world = layout_world(hosts, include=opts.include, exclude=opts.exclude,
                         num_nodes=spec.max_nodes if spec is not None and only_hosts is None else
                         None if spec is not None else opts.num_nodes if listed else None,
                         num_gpus=opts.num_gpus if listed else None,
                         only_hosts=only_hosts)
    env_files = load_env_files(opts.env_file, Path(facts.cwd), Path(facts.home), environ)
    local = [is_local(n.host, facts.hostnames) and not opts.force_multi for n in world.nodes]
    notes: List[str] = []
    source_of = {h.host: h.source for h in hosts}
    for node, here in zip(world.nodes, local):
        if here and facts.gpu_count and max(node.slots) >= facts.gpu_count:
            source = source_of[node.host]
            raise LaunchConfigError(f"{source}: {node.host} would use GPU slot {max(node.slots)} but this machine "
                                    f"has {facts.gpu_count} GPU(s) visible")
    if any(local) and not facts.gpu_count:
        n = sum(node.local_world_size for node, here in zip(world.nodes, local) if here)
        if opts.hostfile and opts.num_gpus is None:  # the hostfile's slots sized it: --num_gpus is not the story
            notes.append(f"no GPU on this machine: its hostfile slots are worker processes; running {n} on the CPU")
        else:
            notes.append(f"no GPU on this machine: --num_gpus counts worker processes; running {n} on the CPU")

    master_addr = opts.master_addr or ("127.0.0.1" if all(local) else
                                       (master_addr_of or (lambda t: t.rpartition("@")[2]))(world.nodes[0].target))
    master_port = opts.master_port
    default_taken = False
    if all(local) and port_in_use is not None and master_port != 0:
        if master_port is None:
            default_taken = port_in_use(master_addr, DEFAULT_MASTER_PORT)
            master_port = 0 if default_taken else None
        elif port_in_use(master_addr, master_port):
            raise LaunchConfigError(f"--master_port {master_port}: already in use on this machine (another job?); "
                                    "choose another, or --master_port 0 for a free one")
    if master_port is None:
        master_port = DEFAULT_MASTER_PORT
    if master_port == 0 and pick_port is not None:
        master_port = pick_port(master_addr)
    if default_taken:
        notes.append(f"port {DEFAULT_MASTER_PORT} is in use on this machine (another job?); "
                     f"using free port {master_port} (--master_port chooses one)")
    ident = RunIdentity(master_addr, master_port, run_id or new_run_id(), 0, opts.max_restarts)
    remote_python = opts.remote_python or facts.python
    bind = (opts.bind_core_list or "") if opts.bind_cores_to_rank else None
    hidden: set = set()
    resize_env = _resize_env(opts, facts, world, spec, base_world, max_world if spec is not None else None)
    nodes = []
    for node, here in zip(world.nodes, local):
        passed, hidden_here = passed_env(opts, environ, env_files, remote=not here)
        workers = []
        for lr in range(node.local_world_size):
            env = dict(passed)
            visible = facts.visible_devices if here and facts.gpu_count else None
            contract = worker_env(world, node, lr, ident, visible_devices=visible)
            del contract["DSLAUNCH_ACCELERATOR"]  # the host's own fact: finish_workers sets it
            if here and not facts.gpu_count:
                # CPU mode: slot numbers are no devices (and GPUs the user hid stay hidden)
                del contract["CUDA_VISIBLE_DEVICES"]
            env.update(contract)
            env.update(resize_env)
            hidden |= hidden_here - contract.keys()  # a contract value replaced the file's: nothing to hide
            argv = worker_argv(opts.script, opts.script_args, lr, python=facts.python if here else remote_python,
                               module=opts.module, no_python=opts.no_python, no_local_rank=opts.no_local_rank)
            workers.append(WorkerPlan(node.first_rank + lr, lr, tuple(argv), env))
        if here:
            workers = finish_workers(workers, accelerator="cuda" if facts.gpu_count else "cpu",
                                     cpu_count=facts.cpu_count, inherited=environ, bind_core_list=bind)
        nodes.append(NodePlan(node, here, tuple(workers), finished=here, bind_core_list=bind))
    if any(local) and not opts.module:
        _check_script(opts, facts)
    return LaunchPlan(opts, world, tuple(nodes), master_addr, master_port, ident.run_id, env_files,
                      frozenset(hidden), remote_python, opts.workdir or facts.cwd, notes, elastic=spec)


def _resize_env(opts: LaunchOptions, facts: MachineFacts, world: World, spec: Optional[ElasticSpec],
                base_world: Optional[int], max_world: Optional[int]) -> Dict[str, str]:
    """The runtime's part of the contract for --checkpoint_dir and elastic jobs (elastic.py)."""
    env: Dict[str, str] = {}
    if opts.checkpoint_dir:
        # absolute: the workers of another --workdir, or another host, must find the same folder
        env[elastic_contract.SAVE_DIR_VAR] = str(Path(facts.cwd, opts.checkpoint_dir))
        if opts.checkpoint_every:
            env[elastic_contract.SAVE_EVERY_VAR] = str(opts.checkpoint_every)
    if spec is not None:
        env[elastic_contract.BASE_WORLD_VAR] = str(base_world or world.world_size)
        env[elastic_contract.MAX_WORLD_VAR] = str(max(max_world or 0, world.world_size))
    return env


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
