"""Bytes on the wire, by process group and by host pair: what the comms logger adds to its
latency records (logger.py) so that a multi-host job can see which collectives cross the
slow link between hosts.

Each rank counts what it sends. A collective over n ranks moves, from this rank to each
other member of the group (the bytes any algorithm must deliver; a ring or tree relays
them, but the delivered payload is this):

    all_gather*          its own piece: output bytes / n
    reduce_scatter*      the other member's share of its input: input bytes / n
    all_to_all*          the block addressed to that member: input bytes / n (even splits)
    all_reduce*          a reduce-scatter and an all-gather of the buffer: 2 * bytes / n
    send / isend         the tensor, to the peer
Other ops (broadcast, barriers, object collectives) are counted by group only.

Records are keyed by (phase, op, group): the phase is whatever the running code set last
with `set_phase` (ZeRO-3 sets "forward", "backward" and "step"), so "the all-gathers of
backward" is one row. Ranks are global ranks; which host holds a rank is learnt only when a
report is made (`report`, collective: every rank sends its records and its host), so
counting costs no communication.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple


def host_key() -> str:
    """This process's host: the launcher's node (NODE_RANK) where it set one, else the hostname."""
    node = os.environ.get("NODE_RANK")
    return f"node{node}" if node not in (None, "") else socket.gethostname()


def per_peer_bytes(op: str, nbytes: int, n: int) -> Optional[float]:
    """Bytes this rank delivers to each other member of an n-rank group, or None when the op
    is not modelled (see the module docstring)."""
    if n <= 1:
        return 0.0
    if op == "all_gather_coalesced":  # its nbytes is this rank's input
        return float(nbytes)
    if op.startswith(("all_gather", "allgather", "reduce_scatter", "all_to_all")):
        return nbytes / n
    if op.startswith(("all_reduce", "inference_all_reduce")):
        return 2.0 * nbytes / n
    return None


@dataclass
class TrafficRow:
    count: int = 0
    nbytes: int = 0  # message bytes as the comms logger counts them
    sent: Dict[int, float] = field(default_factory=dict)  # global rank -> bytes this rank sent it


class TrafficCounter:
    """This rank's counts: {(phase, op, group): TrafficRow}."""

    def __init__(self):
        self.rows: Dict[Tuple[str, str, str], TrafficRow] = {}
        self.phase = ""

    def record(self, op: str, group: str, nbytes: int, me: int, members: Sequence[int],
               peer: Optional[int] = None) -> None:
        row = self.rows.setdefault((self.phase, op, group), TrafficRow())
        row.count += 1
        row.nbytes += int(nbytes)
        if op in ("send", "isend") and peer is not None:
            row.sent[peer] = row.sent.get(peer, 0.0) + nbytes
            return
        each = per_peer_bytes(op, nbytes, len(members))
        if each:
            for r in members:
                if r != me:
                    row.sent[r] = row.sent.get(r, 0.0) + each

    def reset(self) -> None:
        self.rows.clear()

    def snapshot(self) -> Dict[Tuple[str, str, str], TrafficRow]:
        return {k: TrafficRow(v.count, v.nbytes, dict(v.sent)) for k, v in self.rows.items()}


@dataclass
class TrafficReport:
    """Every rank's counts, with the host of every rank (`report` builds it)."""

    hosts: List[str]  # host of each global rank
    ranks: List[Dict[Tuple[str, str, str], TrafficRow]]  # each rank's rows

    def pair_bytes(self, phase: Optional[str] = None, op_prefix: str = "", group: Optional[str] = None
                   ) -> Dict[Tuple[str, str], float]:
        """{(from host, to host): bytes} over the rows matching the filters (summed over ranks)."""
        out: Dict[Tuple[str, str], float] = {}
        for src, rows in enumerate(self.ranks):
            for (ph, op, grp), row in rows.items():
                if (phase is not None and ph != phase) or not op.startswith(op_prefix) or \
                        (group is not None and grp != group):
                    continue
                for dst, b in row.sent.items():
                    key = (self.hosts[src], self.hosts[dst])
                    out[key] = out.get(key, 0.0) + b
        return out

    def inter_host_bytes(self, phase: Optional[str] = None, op_prefix: str = "", group: Optional[str] = None
                         ) -> float:
        return sum(b for (a, c), b in self.pair_bytes(phase, op_prefix, group).items() if a != c)

    def group_rows(self) -> Dict[Tuple[str, str, str], Tuple[int, float, float]]:
        """{(phase, op, group): (calls on rank 0, bytes sent by all ranks, of which between hosts)}."""
        out: Dict[Tuple[str, str, str], List[float]] = {}
        for src, rows in enumerate(self.ranks):
            for key, row in rows.items():
                acc = out.setdefault(key, [0, 0.0, 0.0])
                if src == 0:
                    acc[0] = row.count
                for dst, b in row.sent.items():
                    acc[1] += b
                    if self.hosts[src] != self.hosts[dst]:
                        acc[2] += b
        return {k: (int(v[0]), v[1], v[2]) for k, v in out.items()}

    def table(self) -> str:
        """Bytes by (phase, op, group) and by host pair, as text."""
        lines = [f"{'phase':<9} {'op':<24} {'group':<22} {'calls':>6} {'bytes sent':>14} {'between hosts':>14}"]
        for (ph, op, grp), (calls, sent, inter) in sorted(self.group_rows().items()):
            lines.append(f"{ph or '-':<9} {op:<24} {grp[:22]:<22} {calls:>6} {sent:>14,.0f} {inter:>14,.0f}")
        lines.append("")
        lines.append(f"{'from host':<16} {'to host':<16} {'bytes':>14}")
        for (a, b), v in sorted(self.pair_bytes().items()):
            lines.append(f"{a:<16} {b:<16} {v:>14,.0f}")
        return "\n".join(lines)
