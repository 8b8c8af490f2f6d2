"""--bind_cores_to_rank / --bind_core_list: which CPU cores each local rank may run on.

DeepSpeed's semantics, without numactl: the node's cores (the --bind_core_list, else one
logical CPU per physical core among those this process may use) are cut into
LOCAL_WORLD_SIZE equal consecutive runs; local rank i gets run i, its threads are pinned
there (sched_setaffinity between fork and exec, so every thread it ever starts inherits
it) and OMP_NUM_THREADS is set to the run's length. Cores left over by the division are
not used, as in DeepSpeed. The pure part (parsing, cutting) is apart from the part that
reads /sys.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

from dslaunch.launcher.errors import LaunchConfigError

# Linux numbers CPUs below NR_CPUS, at most 8192 (CONFIG_MAXSMP); the bound also keeps a
# range such as 0-100000000 from being expanded into a hundred million numbers
MAX_CORE = 8191


def _whole(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_core_list(text: str, option: str = "--bind_core_list") -> List[int]:
    """"0,2-4,7" -> [0, 2, 3, 4, 7]; order kept, duplicates refused, no number above MAX_CORE."""
    cores: List[int] = []
    seen = set()
    for part in text.split(","):
        part = part.strip()
        lo, dash, hi = part.partition("-")
        # isascii: str.isdigit() also takes superscripts and other scripts' digits, which int() refuses
        if not _whole(lo) or (dash and not _whole(hi)) or len(part) > 13:
            raise LaunchConfigError(f"{option} {text!r}: {part!r} is not a core number or range like 2-5")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise LaunchConfigError(f"{option} {text!r}: range {part!r} runs backwards")
        if last > MAX_CORE:
            raise LaunchConfigError(f"{option} {text!r}: core {last} is beyond {MAX_CORE}, the highest CPU number "
                                    "Linux can have")
        for c in range(first, last + 1):
            if c in seen:
                raise LaunchConfigError(f"{option} {text!r}: core {c} named twice")
            seen.add(c)
            cores.append(c)
    return cores


def cores_for_rank(cores: Sequence[int], local_world_size: int, local_rank: int,
                   option: str = "--bind_cores_to_rank") -> Tuple[int, ...]:
    per_rank = len(cores) // local_world_size
    if per_rank < 1:
        raise LaunchConfigError(
            f"{option}: {len(cores)} core(s) cannot give each of {local_world_size} local ranks one of its own")
    return tuple(cores[per_rank * local_rank: per_rank * (local_rank + 1)])


def usable_cores(allowed: Optional[Sequence[int]] = None, sys_cpu: str = "/sys/devices/system/cpu") -> List[int]:
    """One logical CPU per physical core among the CPUs this process may run on.

    SMT siblings share a core's execution units, so two ranks pinned to siblings would
    contend exactly as unpinned ranks do; DeepSpeed counts physical cores for the same reason.
    """
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    chosen: List[int] = []
    seen = set()
    for cpu in allowed:
        try:
            with open(f"{sys_cpu}/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings = tuple(parse_core_list(f.read().strip(), "thread_siblings_list"))
        except (OSError, LaunchConfigError):
            siblings = (cpu,)
        if siblings in seen:
            continue
        seen.add(siblings)
        chosen.append(cpu)
    return chosen


def node_core_pool(core_list: Optional[str]) -> List[int]:
    """The cores a node shares among its ranks: the --bind_core_list, else usable_cores()."""
    if core_list:
        cores = parse_core_list(core_list)
        allowed = os.sched_getaffinity(0)
        outside = [c for c in cores if c not in allowed]
        if outside:
            raise LaunchConfigError(f"--bind_core_list {core_list!r}: core(s) {', '.join(map(str, outside))} "
                                    f"are not available here (allowed: {sorted(allowed)})")
        return cores
    return usable_cores()
