"""The worker's end of the datagram socket its node agent opened ($DSLAUNCH_AGENT_SOCKET).

Linux abstract-namespace Unix datagram sockets: no file to clean up, private to the host's
network namespace (the agent and its workers share it), and a send never blocks: when the
agent is slow to read, a progress report is dropped rather than a step delayed.

    worker -> agent  {"rank": 3, "hello": true, "facts": {...}}    once, after initialize
                     {"rank": 3, "step": 120, "saved": 100}       after every optimizer step
    agent -> worker  {"cmd": "drain"}    save at the next step boundary, then stop for a resize
                     {"cmd": "grow"}     stop for a resize after the next periodic checkpoint
"""
from __future__ import annotations

import json
import os
import socket
import uuid
from typing import Any, Dict, Set


def _address(name: str) -> str:
    # "@name" is how the agent writes an abstract name in the variable (as ss and systemd do)
    return "\0" + name[1:] if name.startswith("@") else name


class AgentLink:
    def __init__(self, agent_name: str, rank: int):
        self.rank = rank
        self._agent = _address(agent_name)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + f"dslaunch-worker-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._sock.setblocking(False)

    def send(self, message: Dict[str, Any]) -> None:
        try:
            self._sock.sendto(json.dumps({"rank": self.rank, **message}).encode(), self._agent)
        except OSError:
            pass  # the agent is gone or busy: progress is best effort, the job goes on

    def requests(self) -> Set[str]:
        """Every command that arrived since the last call."""
        got: Set[str] = set()
        while True:
            try:
                data = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return got
            except OSError:
                return got
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("cmd") in ("drain", "grow"):
                got.add(msg["cmd"])

    def close(self) -> None:
        self._sock.close()
