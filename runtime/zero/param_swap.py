"""offload_param.device == "nvme": stage-3 parameter shards rest in files between uses.

A swapped parameter's `ZeroParam.shard` is None at rest; reading `z.shard` brings it back
from its file (or from a read already under way), and `evict` drops it again, writing it
first when the caller changed it. One background thread does all file I/O in order, so a
read queued after a write of the same shard sees the written value; callers never wait
for writes, and the stage-3 engine queues reads of the modules the last forward used next
(`prefetch`) so they overlap the current module's compute. Persistent (small) parameters
are never swapped: they are whole in memory anyway.

Files live in a directory of their own under nvme_path (an ordinary directory works),
one per shard, and are removed by `close`, which first brings every shard back to memory
so the module stays usable after the engine is gone.
"""
from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Iterable, Tuple

import torch

from ..core.comm import shutdown
from .offload import remove_swap_files

# DeepSpeed's deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES (compat/paths.py): the size from
# which its NVMe offload swaps a tensor to its file (smaller ones stay in memory there). Scripts
# size tensors by it so that they are swapped; this swapper swaps shards of every size, so a
# tensor of at least this size is swapped under both.
MIN_SWAPPABLE_BYTES = 1024 ** 2


class ParamSwapper:
    def __init__(self, nvme_path: str, rank: int):
        self.dir = os.path.join(nvme_path, f"dslaunch-zero3-params-rank{rank}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.dir)
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-param-swap")
        self._paths: Dict[int, str] = {}
        self._zs: Dict[int, object] = {}
        self._reads: Dict[int, Future] = {}
        # the value of a shard whose write is still queued: reading it needs no file access
        self._writing: Dict[int, Tuple[Future, torch.Tensor]] = {}
        self._lock = threading.Lock()  # _writing is also emptied from the I/O thread
        self.bytes_read = 0
        self.bytes_written = 0
        # how each `read` was served: from a read queued ahead (`prefetch`), from a write still
        # queued, or from the file while the caller waited (a read the engine did not foresee)
        self.reads_ahead = 0
        self.reads_pending_write = 0
        self.reads_on_demand = 0
        shutdown.register_owner(self.stop)

    def attach(self, zs: Iterable) -> None:
        """Move these shards (now in memory) to their files."""
        for z in zs:
            self._paths[id(z)] = os.path.join(self.dir, f"{len(self._paths)}.pt")
            self._zs[id(z)] = z
            z.swap = self
            self.evict(z, dirty=True)

    # -- I/O on the background thread -------------------------------------------------------
    def _write(self, path: str, t: torch.Tensor) -> None:
        tmp = path + ".tmp"
        torch.save(t, tmp)
        os.replace(tmp, path)
        self.bytes_written += t.numel() * t.element_size()

    def _read(self, path: str) -> torch.Tensor:
        t = torch.load(path, map_location="cpu", weights_only=True)
        self.bytes_read += t.numel() * t.element_size()
        return t

    # -- the caller's side ------------------------------------------------------------------
    def read(self, z) -> torch.Tensor:
        key = id(z)
        fut = self._reads.pop(key, None)
        with self._lock:
            entry = self._writing.get(key)
        if entry is not None:
            if fut is not None:
                fut.cancel()
            self.reads_pending_write += 1
            return entry[1]
        if fut is not None:
            self.reads_ahead += 1
            return fut.result()
        self.reads_on_demand += 1
        return self._read(self._paths[key])

    def prefetch(self, zs: Iterable) -> None:
        for z in zs:
            key = id(z)
            if z.swap is self and z.resident is None and key not in self._reads and key not in self._writing:
                self._reads[key] = self._io.submit(self._read, self._paths[key])

    def evict(self, z, dirty: bool) -> None:
        """Drop the in-memory shard; write it first when `dirty` (it was changed)."""
        t = z.resident
        if t is None:
            return
        key = id(z)
        if dirty:
            stale = self._reads.pop(key, None)
            if stale is not None:
                stale.cancel()
            with self._lock:
                fut = self._io.submit(self._write, self._paths[key], t)
                self._writing[key] = (fut, t)
            fut.add_done_callback(lambda f, key=key, t=t: self._write_done(key, t))
        z.resident = None

    def _write_done(self, key: int, t: torch.Tensor) -> None:
        with self._lock:
            entry = self._writing.get(key)
            if entry is not None and entry[1] is t:  # not superseded by a later write
                del self._writing[key]

    def flush(self) -> None:
        with self._lock:
            pending = list(self._writing.values())
        for fut, _ in pending:
            fut.result()

    def close(self) -> None:
        self.flush()
        for key, z in self._zs.items():
            if z.resident is None:
                z.resident = self.read(z)
            z.swap = None
        self.stop()

    def stop(self) -> None:
        """At interpreter exit (and from close): queued writes finish, the I/O thread
        stops, the files go. Shards still in files are not read back."""
        self.flush()
        self._io.shutdown(wait=True)
        remove_swap_files(self._paths.values(), self.dir)
        self._zs.clear()
