"""The hosts of the Slurm allocation dslaunch runs in (inside `salloc` or an `sbatch` script).

Slurm describes the allocation in the environment: SLURM_JOB_NODELIST in its compressed
form (`gpu[01-03,7],login1`) and SLURM_TASKS_PER_NODE as counts with repeats (`2(x3),1`).
With `--launcher slurm` and no --hostfile, these replace the hostfile: one host per node,
with as many slots as tasks Slurm gave it. Pure: the caller passes the environment.
"""
from __future__ import annotations

import re
from typing import List, Mapping

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import HostSpec

NODELIST = "SLURM_JOB_NODELIST"
TASKS = "SLURM_TASKS_PER_NODE"

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(spec: str) -> List[str]:
    """`a[1-3,07],b` -> a1 a2 a3 a07 b; ranges keep the width of their lower bound (01-03)."""
    names: List[str] = []
    for part in _split_top(spec):
        m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\]([^\[\]]*)", part)
        if m is None:
            if "[" in part or "]" in part or not part:
                raise ValueError(f"cannot read {part!r}")
            names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            rm = _RANGE.match(r)
            if rm is None:
                raise ValueError(f"cannot read range {r!r} in {part!r}")
            lo, hi = rm.group(1), rm.group(2) or rm.group(1)
            if int(hi) < int(lo):
                raise ValueError(f"range {r!r} in {part!r} runs backwards")
            names += [f"{prefix}{str(i).zfill(len(lo))}{suffix}" for i in range(int(lo), int(hi) + 1)]
    return names


def _split_top(spec: str) -> List[str]:
    """Split at commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def expand_counts(spec: str) -> List[int]:
    """`2(x3),1` -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"cannot read {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get(NODELIST))


def allocation_hosts(environ: Mapping[str, str]) -> List[HostSpec]:
    """One HostSpec per node of the allocation; a LaunchConfigError naming the variable if
    Slurm's description cannot be read."""
    try:
        nodes = expand_nodelist(environ[NODELIST])
    except ValueError as exc:
        raise LaunchConfigError(f"{NODELIST}={environ[NODELIST]!r}: {exc}") from None
    spec = environ.get(TASKS, "")
    try:
        counts = expand_counts(spec) if spec else [1] * len(nodes)
    except ValueError as exc:
        raise LaunchConfigError(f"{TASKS}={spec!r}: {exc}") from None
    if len(counts) != len(nodes) or not nodes:
        raise LaunchConfigError(f"{TASKS}={spec!r} does not give one count per node of {NODELIST}="
                                f"{environ[NODELIST]!r} ({len(nodes)} node(s))")
    return [HostSpec(host, None, n, f"{NODELIST}[{i}]") for i, (host, n) in enumerate(zip(nodes, counts))]
