"""The wire between the head and a node agent: one JSON object per line, both ways.

    head -> agent   {"request": {...AgentRequest...}}       first line: what to run
                    {"cmd": "ping"}                          every heartbeat_s
                    {"cmd": "stop"}                          stop the workers now
                    {"cmd": "drain"} / {"cmd": "grow"}       elastic: pass to the workers' runtime
    agent -> head   {"ev": "line", "rank": 3, "stream": "stdout"|"stderr", "data": "text\\n"}
                    {"ev": "hb"}                             every heartbeat_s
                    {"ev": "exited", "label": "host:3"}      a worker ended without failing
                    {"ev": "failed", "failure": {...}}       the moment a worker fails
                    {"ev": "done", "exit_code": 0, "failure": null, "stop_signal": null,
                     "ended": {"host:3": "stopped"}, "dropped": 0}
                    {"ev": "error", "text": "..."}           the agent cannot run the request
                    {"ev": "progress", "step": 120, "saved": 100, "facts": {...}}
                                                             elastic: what the workers' runtime reported
                    {"ev": "leaving"}                        elastic: the agent got SIGTERM (host going away)
                    {"ev": "asked", "cmd": "drain"}          elastic: the request is with every worker

pdsh's control socket opens with a handshake over the one-time token in the request file:

    agent -> head   {"host": "node1", "nonce": "<agent's random hex>", "proof": control_proof(token, "agent", nonce)}
    head -> agent   {"proof": control_proof(token, "head", nonce)}

The token never crosses the wire (an eavesdropper learns one proof bound to one nonce),
and the agent starts nothing until the head's proof checks out.

Either side that hears nothing from the other for heartbeat_timeout seconds gives up
on it: the head declares the host lost, the agent kills its workers. Anything that does
not parse as a JSON object is reported, never fatal: a stray line cannot stop the
agent from noticing EOF or a stop.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from dslaunch.launcher.plan import WorkerPlan


class ProtocolError(ValueError):
    pass


@dataclass(frozen=True)
class AgentRequest:
    """One node's part of one attempt, as its agent needs it."""

    host: str  # the node's target (user@host), which also labels its output
    workers: Tuple[WorkerPlan, ...]
    restart: int
    kill_grace: float
    heartbeat_s: float
    heartbeat_timeout: float
    finished: bool  # host facts already applied (a node of the head's own machine)
    bind_core_list: Optional[str] = None
    elastic: bool = False  # open the workers' socket; SIGTERM asks the head to drain this host

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "workers"}
        d["workers"] = [w.to_dict() for w in self.workers]
        return d

    def to_line(self) -> bytes:
        return encode({"request": self.to_dict()})

    @classmethod
    def from_message(cls, msg: Dict[str, Any]) -> "AgentRequest":
        d = msg.get("request")
        if not isinstance(d, dict):
            raise ProtocolError("the first line is not a request")
        try:
            return cls(str(d["host"]), tuple(WorkerPlan.from_dict(w) for w in d["workers"]), int(d["restart"]),
                       float(d["kill_grace"]), float(d["heartbeat_s"]), float(d["heartbeat_timeout"]),
                       bool(d["finished"]), d.get("bind_core_list"), bool(d.get("elastic", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"malformed request ({type(e).__name__}: {e})") from None


def control_proof(token: str, side: str, nonce: str) -> str:
    """That `side` ("agent" or "head") knows `token`, bound to the agent's fresh `nonce`."""
    return hmac.new(token.encode(), f"dslaunch-control {side} {nonce}".encode(), hashlib.sha256).hexdigest()


def encode(obj: Dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def decode(raw: bytes) -> Optional[Dict[str, Any]]:
    """A JSON object, or None for anything else (not JSON, a list, a number...)."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


PING = encode({"cmd": "ping"})
STOP = encode({"cmd": "stop"})
DRAIN = encode({"cmd": "drain"})
GROW = encode({"cmd": "grow"})
