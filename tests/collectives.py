"""Count the collectives a process runs, per process group, by wrapping torch.distributed's
public functions (each API call is one record: its name and the global ranks of its group).

    rec = CollectiveRecorder().install()
    ...                              # run something
    rec.records                      # [("all_reduce", (0, 1), None), ("send", (0, 1, 2, 3), 2), ...]

Point-to-point records carry the peer's global rank as their third field.

Calls go through `torch.distributed.<name>` at call time everywhere in dslaunch, so
wrapping the module attributes sees them all; torch's internal calls are not counted.
Collectives of same-host groups that run through shared memory (dslaunch.runtime.comm.shm)
never reach torch.distributed: the segment's methods are wrapped too, and record under the
name of the torch.distributed function they stand for; so do the sends and receives of
same-host flows through shared-memory rings (dslaunch.runtime.comm.shm_p2p), on the world
group, with their peer.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch.distributed as dist

NAMES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
         "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter", "send", "recv", "isend",
         "irecv", "batch_isend_irecv")

P2P_NAMES = ("send", "isend", "recv", "irecv")  # shm_p2p's functions, named as torch.distributed's
SHM_NAMES = {"all_reduce": "all_reduce", "reduce": "reduce", "all_gather_into": "all_gather_into_tensor",
             "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}


class CollectiveRecorder:
    def __init__(self):
        self.records: List[Tuple[str, Tuple[int, ...], Optional[int]]] = []
        self._saved = {}
        self._saved_shm = {}
        self._saved_p2p = {}
        self.ring_calls = 0  # of the point-to-point records, those that went through a shared-memory ring

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                group = args[0][0].group if args and args[0] else None
            peer = None
            if name in ("send", "isend", "recv", "irecv"):
                peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
            self.records.append((name, tuple(dist.get_process_group_ranks(group or dist.group.WORLD)), peer))
            return fn(*args, **kwargs)
        return wrapper

    def _wrap_shm(self, name, fn):
        def wrapper(seg, *args, **kwargs):
            self.records.append((name, tuple(seg.ranks), None))
            return fn(seg, *args, **kwargs)
        return wrapper

    def _wrap_p2p(self, name, fn):
        def wrapper(ch, *args, **kwargs):
            self.records.append((name, tuple(dist.get_process_group_ranks(dist.group.WORLD)), ch.peer()))
            self.ring_calls += 1
            return fn(ch, *args, **kwargs)
        return wrapper

    def install(self) -> "CollectiveRecorder":
        from dslaunch.runtime.comm import shm_p2p
        from dslaunch.runtime.comm.shm import Segment

        for name in P2P_NAMES:
            self._saved_p2p[name] = getattr(shm_p2p, name)
            setattr(shm_p2p, name, self._wrap_p2p(name, self._saved_p2p[name]))

        for name in NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        for method, name in SHM_NAMES.items():
            fn = getattr(Segment, method)
            self._saved_shm[method] = fn
            setattr(Segment, method, self._wrap_shm(name, fn))
        return self

    def uninstall(self) -> None:
        from dslaunch.runtime.comm import shm_p2p
        from dslaunch.runtime.comm.shm import Segment

        for name, fn in self._saved_p2p.items():
            setattr(shm_p2p, name, fn)
        self._saved_p2p.clear()

        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        for method, fn in self._saved_shm.items():
            setattr(Segment, method, fn)
        self._saved.clear()
        self._saved_shm.clear()

    def mark(self) -> int:
        return len(self.records)

    def since(self, mark: int) -> List[Tuple[str, Tuple[int, ...], Optional[int]]]:
        return self.records[mark:]
