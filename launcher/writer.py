"""A byte stream written by its own thread through a bounded buffer: the writer never blocks.

Supervision (reacting to a failed worker, to Ctrl-C, to a lost host) must not wait for
whoever reads our output: a terminal paused with Ctrl-S, `| less`, `| (sleep 20; cat)`, a
stuck log shipper, a network partition under an SSH channel. Every destination the
launcher writes to while workers run (the console, each rank's log file, a node agent's
event stream) is therefore a BoundedWriter: write() appends to a buffer of at most
`capacity` bytes and returns at once; one thread per writer does the blocking writes.

Policy when the buffer is full: the chunk is dropped and counted (`dropped`, `dropped_bytes`)
so that the owner can say so at the end; `force=True` chunks (the launcher's own messages,
a node agent's failure and done events) are never dropped, because they are few and
small. A reader that went away for good (EPIPE) ends the writer; later chunks are dropped
silently, as with `dslaunch ... | head`.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import BinaryIO, Callable, Deque, Optional


class BoundedWriter:
    def __init__(self, stream: BinaryIO, capacity: int = 8 << 20, name: str = "dslaunch-writer",
                 on_broken: Optional[Callable[[], None]] = None, flush: bool = True):
        self._stream = stream
        self._capacity = capacity
        self._flush = flush
        self._on_broken = on_broken
        self._queue: Deque[bytes] = collections.deque()
        self._pending = 0
        self._cond = threading.Condition()
        self._closing = False
        self.broken = False
        self.dropped = 0
        self.dropped_bytes = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def write(self, data: bytes, force: bool = False) -> bool:
        """Queue data; False when it was dropped (buffer full, or the reader is gone)."""
        with self._cond:
            if self.broken or self._closing:
                return False
            if not force and self._pending + len(data) > self._capacity:
                self.dropped += 1
                self.dropped_bytes += len(data)
                return False
            self._queue.append(data)
            self._pending += len(data)
            self._cond.notify()
        return True

    @property
    def pending(self) -> int:
        return self._pending

    def close(self, timeout: Optional[float] = None) -> bool:
        """Write what is queued, then stop; False if that did not finish within timeout."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                # write everything queued so far in one call: a slow reader costs one syscall per batch
                chunks = list(self._queue)
                self._queue.clear()
            data = b"".join(chunks)
            try:
                self._stream.write(data)
                if self._flush:
                    self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                with self._cond:
                    self.broken = True
                    self._queue.clear()
                    self._pending = 0
                    self._cond.notify_all()
                if self._on_broken is not None:
                    self._on_broken()
                return
            with self._cond:
                self._pending -= len(data)
                self._cond.notify_all()
