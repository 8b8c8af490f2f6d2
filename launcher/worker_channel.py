"""The node agent's end of the datagram socket its workers' runtime talks to (elastic jobs).

The agent binds an abstract Unix datagram socket (no file; private to the host's network
namespace, which its workers share) and gives its name to every worker as
$DSLAUNCH_AGENT_SOCKET ("@name"). The runtime (runtime/train/resize/link.py) says hello once with
what it knows about the batch at every world size, then reports each optimizer step and the
step of its newest checkpoint; the agent passes a request from the head (drain, grow) to every
worker that said hello, and to each one that says hello later.

The agent forwards what it learns as `progress` events: at once when the facts or the saved
step change, otherwise at most once per `every` seconds (a step every few milliseconds on a
thousand hosts would be most of the head's work).
"""
from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional


class WorkerChannel:
    def __init__(self, emit: Callable[[dict], None], every: float):
        self.name = f"@dslaunch-agent-{uuid.uuid4().hex}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + self.name[1:])
        self._emit = emit
        self._every = every
        self._lock = threading.Lock()
        self._workers: Dict[bytes, int] = {}  # address -> rank
        self._requests: List[str] = []  # every request the head sent, for workers that say hello later
        self._step: Optional[int] = None
        self._saved: Optional[int] = None
        self._facts: Optional[dict] = None
        self._sent_at = 0.0
        self._sent_step: Optional[int] = None
        self._closed = False
        threading.Thread(target=self._read, daemon=True, name="dslaunch-agent-workers").start()

    def request(self, cmd: str) -> None:
        """Pass a request to every worker that said hello (and keep it for those that will), then
        tell the head: once it is told, every worker has the request queued on its socket and acts
        on it at its next optimizer step."""
        with self._lock:
            if cmd not in self._requests:
                self._requests.append(cmd)
            addresses = list(self._workers)
        for addr in addresses:
            self._send(addr, cmd)
        self._emit({"ev": "asked", "cmd": cmd, "workers": len(addresses)})

    def _send(self, addr, cmd: str) -> None:
        try:
            self._sock.sendto(json.dumps({"cmd": cmd}).encode(), addr)
        except OSError:
            pass  # that worker is gone

    def _read(self) -> None:
        while True:
            try:
                data, addr = self._sock.recvfrom(1 << 20)
            except OSError:
                return
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            self._take(msg, addr)

    def _take(self, msg: dict, addr) -> None:
        now = time.monotonic()
        urgent = False
        with self._lock:
            if msg.get("hello") and addr:
                self._workers[addr] = int(msg.get("rank", -1))
                pending = list(self._requests)
                facts = msg.get("facts")
                if facts and facts != self._facts:
                    self._facts, urgent = facts, True
            else:
                pending = []
            step, saved = msg.get("step"), msg.get("saved")
            if isinstance(step, int) and (self._step is None or step > self._step):
                self._step = step
            if isinstance(saved, int) and saved != self._saved:
                self._saved, urgent = saved, True
            due = urgent or (self._step != self._sent_step and now - self._sent_at >= self._every)
            if due:
                event = {"ev": "progress", "step": self._step, "saved": self._saved}
                if urgent and self._facts is not None:
                    event["facts"] = self._facts
                self._sent_at, self._sent_step = now, self._step
        for cmd in pending:
            self._send(addr, cmd)
        if due:
            self._emit(event)

    def flush(self) -> None:
        """The last progress, if not yet sent (the agent's heartbeat calls this)."""
        with self._lock:
            if self._step is None or self._step == self._sent_step:
                return
            event = {"ev": "progress", "step": self._step, "saved": self._saved}
            self._sent_at, self._sent_step = time.monotonic(), self._step
        self._emit(event)

    def close(self) -> None:
        self._sock.close()
