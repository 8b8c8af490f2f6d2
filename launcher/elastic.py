"""Elastic jobs, the pure part: the options' meaning, re-planning, and the one-line messages.

An elastic job (`--min_nodes N`, DeepSpeed's `--elastic_training`, torchrun's `--nnodes
MIN:MAX`) runs on between N and `--max_nodes` hosts of the hostfile. A host that is lost
(its agent's connection dropped, its heartbeat stopped, its agent could not start) or
drained (`dslaunch drain HOST`, SIGTERM to its agent) ends the attempt; the head re-plans
the ranks on the hosts left and starts the script again, which resumes from the last
complete checkpoint at the new size (runtime/train/resize/). A host that answers again joins at
the next checkpoint, up to --max_nodes. elastic_head.py drives this; everything here is
arithmetic on names and numbers, so the unit tests cover it without processes.

The worker contract (the runtime reads the same names, runtime/train/resize/contract.py):
    DSLAUNCH_SAVE_DIR, DSLAUNCH_SAVE_EVERY   --checkpoint_dir, --checkpoint_every
    DSLAUNCH_BASE_WORLD_SIZE                 the world size the global batch is configured for
                                             (the job at --max_nodes hosts)
    DSLAUNCH_MAX_WORLD_SIZE                  the largest world the job may grow to
    DSLAUNCH_AGENT_SOCKET                    the node agent's datagram socket (set by the agent)
A worker that stops for a resize (after saving) exits with RESIZE_EXIT_CODE.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher.errors import LaunchConfigError

SAVE_DIR_VAR = "DSLAUNCH_SAVE_DIR"
SAVE_EVERY_VAR = "DSLAUNCH_SAVE_EVERY"
BASE_WORLD_VAR = "DSLAUNCH_BASE_WORLD_SIZE"
MAX_WORLD_VAR = "DSLAUNCH_MAX_WORLD_SIZE"
AGENT_SOCKET_VAR = "DSLAUNCH_AGENT_SOCKET"
# EX_TEMPFAIL: "a temporary failure; the user is invited to retry". A worker exits with it
# after the checkpoint a resize asked for: the head then starts the job at the new size.
RESIZE_EXIT_CODE = 75


@dataclass(frozen=True)
class ElasticSpec:
    """The host-count bounds of an elastic job."""

    min_nodes: int
    max_nodes: int


def parse_nnodes(text: str) -> Tuple[int, int]:
    """torchrun's `--nnodes MIN:MAX` -> (MIN, MAX). A single number is refused: it means a fixed
    node count started by one torchrun per node, which dslaunch does from one machine."""
    lo, colon, hi = text.partition(":")
    if not colon:
        raise LaunchConfigError("--nnodes: dslaunch starts every node from one machine: list the hosts in "
                                "--hostfile (--num_nodes N uses the first N) and run dslaunch once "
                                "(--nnodes MIN:MAX: an elastic job of MIN to MAX hosts)")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise LaunchConfigError(f"--nnodes {text}: expected MIN:MAX, two whole numbers (e.g. 2:4)") from None


def resolve_spec(min_nodes: Optional[int], max_nodes: Optional[int], pool: int,
                 num_nodes: Optional[int] = None) -> Optional[ElasticSpec]:
    """The bounds for a pool of `pool` hosts (the hostfile after --include/--exclude), or None
    for a job of fixed size. Refused in one line: a bound below 1, min above max, more hosts
    asked for than the hostfile lists, and --num_nodes beside them (--max_nodes says it)."""
    if min_nodes is None and max_nodes is None:
        return None
    if num_nodes is not None:
        raise LaunchConfigError("--num_nodes cannot be combined with --min_nodes/--max_nodes: an elastic job runs "
                                "on up to --max_nodes hosts of the hostfile")
    lo = 1 if min_nodes is None else min_nodes
    hi = pool if max_nodes is None else max_nodes
    for name, value in (("--min_nodes", lo), ("--max_nodes", hi)):
        if value < 1:
            raise LaunchConfigError(f"{name} {value}: must be at least 1")
    if lo > pool:
        raise LaunchConfigError(f"--min_nodes {lo}: the hostfile lists only {pool} host(s)")
    if hi > pool:
        raise LaunchConfigError(f"--max_nodes {hi}: the hostfile lists only {pool} host(s)")
    if lo > hi:
        raise LaunchConfigError(f"--min_nodes {lo} is above --max_nodes {hi}")
    return ElasticSpec(lo, hi)


@dataclass(frozen=True)
class Facts:
    """What the runtime reported about the job's batch, in one of two forms:
    - a rule (no `elasticity` section): the global batch, the micro batch and the model-parallel
      degree; a world size can run when its data ranks (world / model) split the batch into
      whole micro batches, with accumulation batch / (micro x data ranks);
    - `sizes` (an `elasticity` section): world size -> (micro batch, accumulation), the sizes
      its rules allow.
    Neither: nothing reported (a script without the runtime, or not started yet); then every
    world size is tried."""

    sizes: Mapping[int, Tuple[int, int]] = field(default_factory=dict)
    batch: Optional[int] = None
    micro: Optional[int] = None
    model: int = 1

    @classmethod
    def from_report(cls, report: Optional[Mapping]) -> "Facts":
        report = dict(report or {})
        sizes: Dict[int, Tuple[int, int]] = {}
        for k, v in dict(report.get("sizes") or {}).items():
            try:
                sizes[int(k)] = (int(v[0]), int(v[1]))
            except (TypeError, ValueError, IndexError):
                continue
        try:
            batch, micro, model = int(report["batch"]), int(report["micro"]), int(report.get("model", 1))
        except (KeyError, TypeError, ValueError):
            return cls(sizes)
        if batch < 1 or micro < 1 or model < 1:
            return cls(sizes)
        return cls(sizes, batch, micro, model)

    def _split(self, world: int) -> Optional[Tuple[int, int]]:
        if self.batch is not None:
            if world % self.model or self.batch % (self.micro * (world // self.model)):
                return None
            return self.micro, self.batch // (self.micro * (world // self.model))
        return self.sizes.get(world)

    def allows(self, world: int) -> bool:
        return (self.batch is None and not self.sizes) or self._split(world) is not None

    def accumulation(self, world: int) -> Optional[int]:
        got = self._split(world)
        return got[1] if got else None

    def describe(self) -> str:
        if self.batch is not None:
            model = f" (model-parallel degree {self.model})" if self.model > 1 else ""
            return f"the global batch {self.batch} must split into micro batches of {self.micro} per data rank{model}"
        return "the config's elasticity section allows world sizes " + (", ".join(str(w) for w in sorted(self.sizes))
                                                                         or "none")


@dataclass(frozen=True)
class Choice:
    hosts: Tuple[str, ...]  # in hostfile order
    world: int


def choose_hosts(candidates: Sequence[str], slots: Mapping[str, int], spec: ElasticSpec,
                 facts: Facts) -> Optional[Choice]:
    """The hosts the next attempt runs on: the most (at most --max_nodes, at least
    --min_nodes) of `candidates` (hostfile order) whose world size the batch allows, taking
    them in hostfile order; None when no count in [min, max] works."""
    top = min(spec.max_nodes, len(candidates))
    for k in range(top, spec.min_nodes - 1, -1):
        hosts = tuple(candidates[:k])
        world = sum(slots[h] for h in hosts)
        if facts.allows(world):
            return Choice(hosts, world)
    return None


def why_no_choice(candidates: Sequence[str], slots: Mapping[str, int], spec: ElasticSpec, facts: Facts) -> str:
    """The reason choose_hosts found nothing, as the end of a one-line message."""
    if len(candidates) < spec.min_nodes:
        return f"{len(candidates)} host(s) left, below --min_nodes {spec.min_nodes}"
    worlds = sorted({sum(slots[h] for h in candidates[:k])
                     for k in range(spec.min_nodes, min(spec.max_nodes, len(candidates)) + 1)})
    return (f"the batch allows no world size of {', '.join(str(w) for w in worlds)} rank(s) on the hosts left "
            f"({facts.describe()})")


def steps(n: Optional[int]) -> str:
    """A step number as the messages show it: 1,240."""
    return "?" if n is None else f"{n:,}"


def resume_clause(hosts: int, of: int, saved: Optional[int], has_dir: bool,
                  gas: Tuple[Optional[int], Optional[int]]) -> str:
    """`resuming on 3 of 4 hosts from step 1,200, accumulation 4 -> 6`."""
    if saved is not None:
        where = f"from step {steps(saved)}"
    elif has_dir:
        where = "from the start (no checkpoint yet)"
    else:
        where = "from the script's own checkpoint (no --checkpoint_dir)"
    text = f"resuming on {hosts} of {of} hosts {where}"
    old, new = gas
    if old is not None and new is not None and old != new:
        text += f", accumulation {old} -> {new}"
    return text


def lost_reason(reason: str) -> str:
    """A host failure's reason, short, for the `host X lost at step N (...)` line."""
    if reason.startswith("lost: nothing from its agent for"):
        seconds = reason.split("for ", 1)[1].split("s", 1)[0]
        return f"no heartbeat for {seconds} s"
    if reason.startswith("lost its node agent"):
        return "its agent's connection dropped"
    if reason.startswith("cannot start the node agent"):
        return reason
    return reason


def backoff(failures: int, interval: float, cap: float = 300.0) -> float:
    """Seconds before a host that failed to join `failures` times in a row is tried again."""
    return min(cap, interval * (2 ** max(0, failures)))


def in_order(hosts: Sequence[str], order: Sequence[str]) -> List[str]:
    """`hosts` sorted as they appear in `order` (the hostfile); unknown ones last, as given."""
    rank = {h: i for i, h in enumerate(order)}
    return sorted(hosts, key=lambda h: rank.get(h, len(rank)))
