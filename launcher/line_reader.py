"""One thread reads the line streams of every node agent link: a selector over their fds.

A reader thread per link (two with the agent's stderr) made one or two threads per host: at
a thousand hosts the head's threads woke by the thousand on every heartbeat round and at
teardown, and handing the GIL between them cost more CPU than the events themselves. Links
whose transport is a file descriptor (a pipe to a local agent, a socket) register it here;
the others (paramiko channels, which are read through their own API) keep a thread each.

Each fd is read once per readiness report, so it may stay blocking (a socket shared with a
sender thread must): a read on a ready pipe or socket returns what is there without waiting.
"""
from __future__ import annotations

import os
import selectors
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

READ_SIZE = 65536


@dataclass
class _Stream:
    on_line: Callable[[bytes], None]  # each line with its b"\n" (the last one may lack it)
    on_eof: Callable[[], None]
    partial: bytearray = field(default_factory=bytearray)


class LineReader:
    """add(fd, on_line, on_eof) from any thread; callbacks run on the reader's thread and must not block."""

    def __init__(self, name: str = "dslaunch-links-in"):
        self._name = name
        self._lock = threading.Lock()
        self._pending: List[Tuple[int, _Stream]] = []
        self._thread: Optional[threading.Thread] = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def add(self, fd: int, on_line: Callable[[bytes], None], on_eof: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append((fd, _Stream(on_line, on_eof)))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
                self._thread.start()
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # a wake-up is already waiting

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        while True:
            for key, _ in sel.select():
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    self._register_pending(sel)
                else:
                    self._read(sel, key.fd, key.data)

    def _register_pending(self, sel: selectors.BaseSelector) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fd, stream in pending:
            try:
                sel.register(fd, selectors.EVENT_READ, stream)
            except KeyError:
                # the number was closed under us and reused for this new fd: the old stream is over
                self._end(sel, fd, sel.get_key(fd).data)
                sel.register(fd, selectors.EVENT_READ, stream)
            except (OSError, ValueError):  # closed before it was registered: nothing more to read
                self._finish(stream)

    def _read(self, sel: selectors.BaseSelector, fd: int, stream: _Stream) -> None:
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:  # a reset connection, a closed fd: the stream is over
            data = b""
        if not data:
            self._end(sel, fd, stream)
            return
        buf = stream.partial
        buf += data
        end = buf.rfind(b"\n")
        if end < 0:
            return
        lines = bytes(buf[: end + 1]).splitlines(keepends=True)
        del buf[: end + 1]
        for line in lines:
            self._call(stream.on_line, line)

    def _end(self, sel: selectors.BaseSelector, fd: int, stream: _Stream) -> None:
        try:
            sel.unregister(fd)
        except (KeyError, ValueError):
            pass
        self._finish(stream)

    def _finish(self, stream: _Stream) -> None:
        if stream.partial:
            self._call(stream.on_line, bytes(stream.partial))
            stream.partial.clear()
        self._call(stream.on_eof)

    @staticmethod
    def _call(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            pass  # one link's callback must not end the reading of every other link


_shared: Optional[LineReader] = None
_shared_lock = threading.Lock()


def shared_reader() -> LineReader:
    """The process's reader for agent links (its thread starts with the first stream added)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = LineReader()
        return _shared
