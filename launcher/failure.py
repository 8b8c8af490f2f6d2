"""The one failure type, from the worker's supervisor through the node agent to the head.

A Failure is either a worker's (rank set: it exited non-zero, died by a signal, or could
not start) or a host's (rank None: its agent's connection dropped, it fell silent past
--heartbeat_timeout, its agent could not start). The node agent sends it to the head as
to_dict() inside a JSON event and the head rebuilds it with from_dict(): no string is
parsed back into fields anywhere.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, Optional, Tuple

from dslaunch.launcher.reaper import signal_name

# A host that is lost or whose agent could not run: the job's exit code, as ssh and pdsh use it.
HOST_FAILURE_CODE = 255


@dataclass(frozen=True)
class Failure:
    rank: Optional[int]  # None: the host failed, not one of its workers
    label: str  # how output names it: "rank 3" on this machine, "host:3" or "host" elsewhere
    exit_code: int  # shell style: 128+N for signal N
    signal: Optional[int] = None
    reason: str = ""  # a host failure's cause, or why a worker could not start
    stderr_tail: Tuple[str, ...] = ()
    elapsed_s: Optional[float] = None
    host: Optional[str] = None  # set once the failure leaves its host

    def how(self) -> str:
        if self.reason:
            return self.reason
        if self.signal:
            return f"killed by {signal_name(self.signal)} (exit code {self.exit_code})"
        return f"exited with code {self.exit_code}"

    def describe(self) -> str:
        after = f" after {self.elapsed_s:.1f}s" if self.elapsed_s is not None else ""
        return f"{self.label} failed first: {self.how()}{after}"

    def on_host(self, host: str) -> "Failure":
        """The same failure as the head names it: `host:rank`."""
        label = f"{host}:{self.rank}" if self.rank is not None else host
        return replace(self, host=host, label=label)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stderr_tail"] = list(self.stderr_tail)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Failure":
        return cls(
            rank=None if d.get("rank") is None else int(d["rank"]),
            label=str(d.get("label", "")),
            exit_code=int(d.get("exit_code", 1)),
            signal=None if d.get("signal") is None else int(d["signal"]),
            reason=str(d.get("reason", "")),
            stderr_tail=tuple(str(t) for t in d.get("stderr_tail", ())),
            elapsed_s=None if d.get("elapsed_s") is None else float(d["elapsed_s"]),
            host=d.get("host"),
        )


def host_failure(host: str, reason: str) -> Failure:
    return Failure(rank=None, label=host, exit_code=HOST_FAILURE_CODE, reason=reason, host=host)
