"""The data axis split by host: which ranks of a group share a machine, for ZeRO++'s
hierarchical collectives (qgZ reduces inside a host before crossing hosts; hpZ keeps a copy
of the parameters inside each host).

A rank's host is the launcher's node (NODE_RANK, which dslaunch, torchrun and the MPI/Slurm
shims set) or, without one, its hostname (comm.traffic.host_key). `discover` learns every
member's host with one all_gather_object over the group; `HostSplit` is the pure arithmetic
on top: the ranks of each host in group order, and the "cross" lines (the i-th rank of every
host), as DeepSpeed lays them out (its local and global all-to-all groups). The split needs
each host's ranks to be consecutive in the group and every host to hold the same number;
`problem()` says in one line where that fails.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class HostSplit:
    ranks: Tuple[int, ...]  # the group's global ranks, in group order
    hosts: Tuple[str, ...]  # the host of each

    @property
    def host_names(self) -> List[str]:
        """Distinct hosts, in order of first appearance."""
        seen: Dict[str, None] = {}
        for h in self.hosts:
            seen.setdefault(h, None)
        return list(seen)

    @property
    def n_hosts(self) -> int:
        return len(self.host_names)

    def per_host(self) -> List[List[int]]:
        """Each host's ranks (global), in group order."""
        out: Dict[str, List[int]] = {}
        for r, h in zip(self.ranks, self.hosts):
            out.setdefault(h, []).append(r)
        return list(out.values())

    def problem(self) -> Optional[str]:
        """Why the group cannot be split into equal runs of consecutive ranks per host (None: it can)."""
        blocks = self.per_host()
        sizes = sorted({len(b) for b in blocks})
        if len(sizes) > 1:
            counts = ", ".join(f"{h}: {len(b)}" for h, b in zip(self.host_names, blocks))
            return f"the hosts hold different numbers of its ranks ({counts})"
        pos = {r: i for i, r in enumerate(self.ranks)}
        for h, b in zip(self.host_names, blocks):
            idx = [pos[r] for r in b]
            if idx != list(range(idx[0], idx[0] + len(idx))):
                return f"host {h}'s ranks {b} are not consecutive in the group"
        return None

    @property
    def local_size(self) -> int:
        """Ranks per host (after problem() said None)."""
        return len(self.ranks) // self.n_hosts

    def local_lists(self, size: Optional[int] = None) -> List[List[int]]:
        """Runs of `size` consecutive ranks (default: a whole host) inside each host."""
        size = size or self.local_size
        out = []
        for block in self.per_host():
            out += [block[i:i + size] for i in range(0, len(block), size)]
        return out

    def cross_lists(self) -> List[List[int]]:
        """For each position i inside a host: the i-th rank of every host."""
        blocks = self.per_host()
        return [[b[i] for b in blocks] for i in range(self.local_size)]

    def host_of(self, rank: int) -> str:
        return self.hosts[self.ranks.index(rank)]


def discover(group, ranks: Sequence[int]) -> HostSplit:
    """Collective over `group` (whose global ranks, in group order, are `ranks`): every
    member's host."""
    from .. import comm
    from ..comm.traffic import host_key

    everyone: List[Optional[str]] = [None] * len(ranks)
    comm.all_gather_object(everyone, host_key(), group=group, label="hosts of the data-parallel ranks")
    return HostSplit(tuple(int(r) for r in ranks), tuple(str(h) for h in everyone))
