"""World layout and the per-worker environment contract. Pure functions only.

Layout: an ordered pool of hosts and their slots (from a hostfile, or this machine alone),
narrowed by DeepSpeed-style filters or by --num_nodes/--num_gpus, becomes a list of nodes.
Node ranks follow pool order; global ranks are consecutive within a node, so node k owns
ranks [first_rank, first_rank + local_world_size). A node's slots are the device indices
its workers use: LOCAL_RANK i drives slots[i], which is why LOCAL_RANK is always the index
within the node even when nodes have different slot counts.

Filter syntax (--include/--exclude): hosts separated by '@', each optionally followed by
':' and a comma-separated slot list, e.g. `worker-0@worker-1:0,2`. A host without a slot
list means all of its slots.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import HostSpec, join_user


@dataclass(frozen=True)
class Node:
    """One host's share of the job."""

    node_rank: int
    host: str
    user: Optional[str]
    slots: Tuple[int, ...]  # device indices, in LOCAL_RANK order
    first_rank: int

    @property
    def target(self) -> str:
        """`user@host` (or `host`): what SSH connects to and how output names this node."""
        return join_user(self.user, self.host)

    @property
    def local_world_size(self) -> int:
        return len(self.slots)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + len(self.slots))


@dataclass(frozen=True)
class World:
    nodes: Tuple[Node, ...]

    # computed once: worker_env asks for it per worker, and a sum per ask made planning
    # quadratic in the number of hosts (160 s for 10,000 hosts)
    @cached_property
    def world_size(self) -> int:
        return sum(n.local_world_size for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)


def parse_filter(expr: str, option: str) -> "OrderedDict[str, Optional[List[int]]]":
    """`a@b:0,2` -> {"a": None, "b": [0, 2]}; None means every slot of that host.

    As in DeepSpeed, a host named more than once gets the union of its slots
    (`w0:1@w0:0,1` -> w0: [0, 1]) and a repeated slot counts once (`w0:1,1` -> [1]);
    a bare host name means all of its slots, whatever else names it.
    """
    out: "OrderedDict[str, Optional[List[int]]]" = OrderedDict()
    for part in expr.split("@"):
        host, colon, slot_text = part.partition(":")
        host = host.strip()
        if not host:
            raise LaunchConfigError(f"{option} {expr!r}: empty host name")
        if not colon:
            out[host] = None
            continue
        slots: List[int] = []
        for s in slot_text.split(","):
            s = s.strip()
            if not s.isdigit() or not s.isascii() or len(s) > 6:
                raise LaunchConfigError(f"{option} {expr!r}: slot {s!r} of host {host!r} is not a whole number")
            slots.append(int(s))
        if host in out and out[host] is None:
            continue
        merged = set(out.get(host) or ()) | set(slots)
        out[host] = sorted(merged)
    return out


def _apply_filter(pool: "OrderedDict[str, List[int]]", expr: str, option: str, include: bool,
                  allow_empty: bool = False) -> "OrderedDict[str, List[int]]":
    wanted = parse_filter(expr, option)
    for host, slots in wanted.items():
        if host not in pool:
            raise LaunchConfigError(f"{option} {expr!r}: unknown host {host!r} (known: {', '.join(pool)})")
        for s in slots or ():
            if s not in pool[host]:
                raise LaunchConfigError(
                    f"{option} {expr!r}: host {host!r} has no slot {s} (slots 0-{len(pool[host]) - 1})"
                )
    result: "OrderedDict[str, List[int]]" = OrderedDict()
    for host, avail in pool.items():
        if include:
            if host not in wanted:
                continue
            chosen = wanted[host]
            kept = list(avail) if chosen is None else [s for s in avail if s in chosen]
        else:
            dropped = wanted.get(host, [])
            kept = [] if host in wanted and dropped is None else [s for s in avail if s not in (dropped or [])]
        if kept:
            result[host] = kept
    if not result and not allow_empty:  # allow_empty: DeepSpeed's parse_resource_filter (the compat package)
        raise LaunchConfigError(f"{option} {expr!r}: no slots left to run on")
    return result


def check_selection(include: str, exclude: str, num_nodes: Optional[int], num_gpus: Optional[int]) -> None:
    """As in DeepSpeed, --include/--exclude pick exact slots and so cannot be combined with
    --num_nodes/--num_gpus, nor with each other."""
    if include and exclude:
        raise LaunchConfigError("--include and --exclude cannot be used together")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        which = "--include" if include else "--exclude"
        counts = "--num_nodes" if num_nodes is not None else "--num_gpus"
        raise LaunchConfigError(f"{which} cannot be combined with {counts}: the filter already picks the slots")


def layout_world(
    hosts: Sequence[HostSpec],
    *,
    include: str = "",
    exclude: str = "",
    num_nodes: Optional[int] = None,
    num_gpus: Optional[int] = None,
    only_hosts: Optional[Sequence[str]] = None,
) -> World:
    """Hosts (in hostfile order) + filters + counts -> nodes with ranks and slots.

    As in DeepSpeed, --include/--exclude pick exact slots and so cannot be combined with
    --num_nodes/--num_gpus, which take the first N hosts / first N slots of each host.
    Asking for more nodes or slots than exist is an error, never a silent shrink.
    `only_hosts` (an elastic job re-planned on the hosts it has) keeps those hosts of the
    filtered pool, in pool order, instead of the first --num_nodes.
    """
    if not hosts:
        raise LaunchConfigError("no hosts to run on")
    check_selection(include, exclude, num_nodes, num_gpus)
    pool: "OrderedDict[str, List[int]]" = OrderedDict((h.host, list(range(h.slots))) for h in hosts)
    by_name: Dict[str, HostSpec] = {h.host: h for h in hosts}
    if include:
        pool = _apply_filter(pool, include, "--include", include=True)
    elif exclude:
        pool = _apply_filter(pool, exclude, "--exclude", include=False)
    if only_hosts is not None:
        wanted = set(only_hosts)
        pool = OrderedDict((h, s) for h, s in pool.items() if h in wanted)
        if not pool:
            raise LaunchConfigError("no hosts to run on")
    elif num_nodes is not None:
        if num_nodes < 1:
            raise LaunchConfigError(f"--num_nodes {num_nodes}: must be at least 1")
        if num_nodes > len(pool):
            raise LaunchConfigError(f"--num_nodes {num_nodes}: only {len(pool)} host(s) available")
        pool = OrderedDict(list(pool.items())[:num_nodes])
    if num_gpus is not None:
        if num_gpus < 1:
            raise LaunchConfigError(f"--num_gpus {num_gpus}: must be at least 1")
        for host, slots in pool.items():
            if num_gpus > len(slots):
                raise LaunchConfigError(
                    f"--num_gpus {num_gpus}: host {host!r} has only slots={len(slots)} ({by_name[host].source})"
                )
        pool = OrderedDict((h, s[:num_gpus]) for h, s in pool.items())
    nodes = []
    next_rank = 0
    for node_rank, (host, slots) in enumerate(pool.items()):
        nodes.append(Node(node_rank, host, by_name[host].user, tuple(slots), next_rank))
        next_rank += len(slots)
    return World(tuple(nodes))


@dataclass(frozen=True)
class RunIdentity:
    """What every worker of one attempt shares besides the layout."""

    master_addr: str
    master_port: int
    run_id: str
    restart_count: int = 0
    max_restarts: int = 0


def worker_env(
    world: World,
    node: Node,
    local_rank: int,
    ident: RunIdentity,
    *,
    accelerator: str = "cuda",
    visible_devices: Optional[Sequence[str]] = None,
    omp_threads: Optional[int] = None,
) -> Dict[str, str]:
    """The variables a worker gets on top of the inherited environment.

    The union of what DeepSpeed's launcher and torchrun set, so scripts written for
    either run unchanged. `visible_devices` is the CUDA_VISIBLE_DEVICES list this node's
    launcher itself inherited: slot i then means the i-th of those devices, not physical
    device i. `omp_threads` is set only when the caller found OMP_NUM_THREADS unset.
    """
    if not 0 <= local_rank < node.local_world_size:
        raise ValueError(f"local_rank {local_rank} outside node {node.host} with {node.local_world_size} slots")
    rank = node.first_rank + local_rank
    if visible_devices is not None:
        devices = [visible_devices[s] for s in node.slots]
    else:
        devices = [str(s) for s in node.slots]
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_WORLD_SIZE": str(node.local_world_size),
        "LOCAL_SIZE": str(node.local_world_size),
        "NODE_RANK": str(node.node_rank),
        "GROUP_RANK": str(node.node_rank),
        "GROUP_WORLD_SIZE": str(world.num_nodes),
        "CROSS_RANK": str(node.node_rank),
        "CROSS_SIZE": str(world.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world.world_size),
        "MASTER_ADDR": ident.master_addr,
        "MASTER_PORT": str(ident.master_port),
        "CUDA_VISIBLE_DEVICES": ",".join(devices),
        "DSLAUNCH_ACCELERATOR": accelerator,
        "DSLAUNCH_RUN_ID": ident.run_id,
        "DSLAUNCH_RESTART_COUNT": str(ident.restart_count),
        "TORCHELASTIC_RUN_ID": ident.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(ident.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(ident.max_restarts),
        # Python buffers stdout when it is a pipe; unbuffered lines reach the user as they happen.
        "PYTHONUNBUFFERED": "1",
    }
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def worker_argv(
    script: str,
    script_args: Sequence[str],
    local_rank: int,
    *,
    python: str,
    module: bool = False,
    no_python: bool = False,
    no_local_rank: bool = False,
) -> List[str]:
    """The command one worker runs. Script arguments are passed through exactly as given."""
    if module and no_python:
        raise LaunchConfigError("--module and --no_python cannot be used together")
    if no_python:
        argv = [script]
    elif module:
        argv = [python, "-u", "-m", script]
    else:
        argv = [python, "-u", script]
    if not no_local_rank:
        argv.append(f"--local_rank={local_rank}")
    argv.extend(script_args)
    return argv


def contract_keys() -> Tuple[str, ...]:
    """Names of every variable worker_env may set, for --dry_run and for the remote agent."""
    w = World((Node(0, "h", None, (0,), 0),))
    return tuple(worker_env(w, w.nodes[0], 0, RunIdentity("a", 1, "r"), omp_threads=1))
