"""Point-to-point through shared memory, between two ranks of one host.

gloo carries a send between two processes of one machine over loopback TCP, through the
kernel and gloo's threads on both sides. Here each flow (sender, receiver, tag) has a ring
of SLOTS preallocated slots in an anonymous shared file the sender made and the receiver
mapped: a message is cut into pieces of at most SLOT_BYTES, one piece per slot; the sender
counts the slots it has filled (`written`), the receiver the slots it has emptied (`read`),
both sequence numbers that only grow, so slot k % SLOTS is free for piece k when
k - read < SLOTS and full for the receiver when k < written. Sender and receiver agree on
the pieces without a word: the receiver knows the size of what it receives (the pipeline's
header says it, as it does for gloo).

Which flows: set up by connect(), a collective of one process group (the pipeline's stages
of one replica), with the flows each rank will send and receive. A flow uses a ring only
when both of its ranks name the same host (traffic.host_key: the launcher's NODE_RANK, else
the hostname), see each other's pid and could map the file; every other flow stays on gloo,
and the two ranks decide alike (the result is exchanged over the group). comm.send, isend,
recv and irecv then route a CPU tensor to a flow's ring when it has one (collectives.py).

An isend does not wait for the receiver: pieces that do not fit are kept in the flow's queue
(with the tensor, as gloo's isend keeps its own) and written as slots free up, by the next
call that touches this process's rings; any wait in here first moves every queued piece it
can, so a rank blocked on a receive still drains its own isends and two ranks cannot wait on
each other's full rings through them. isend()'s handle, and send(), wait until every piece
of the message is in the ring (not until it is received: less than gloo's send waits for, so
an order of blocking sends that is safe over gloo is safe here); wait_all() before a batch ends.

Waiting and memory order are shm.py's (x86-64 only, futex sleeps, a peer that exited is
an error within a second): data is written before its counter and read after it, and the
counter is stored after a locked instruction.
DSLAUNCH_SHM_COMM=0 keeps every flow on gloo, as it does every collective.
"""
from __future__ import annotations

import collections
import ctypes
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Deque, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d  # the set-up exchange: not the job's collectives

from . import shm

SLOTS = 4
SLOT_BYTES = 1 << 20  # a megabyte slot moves as fast as larger ones here (shm.py's region size)
_LINE = 64
_TOKEN = 16
# header lines: token; written; read; writer pid; reader pid
_WRITTEN, _READ, _WRITER, _READER = 1, 2, 3, 4
_HEAD = 5 * _LINE

Flow = Tuple[int, int, int]  # (sender's global rank, receiver's global rank, tag)


def pieces(nbytes: int, slot_bytes: int = SLOT_BYTES) -> List[Tuple[int, int]]:
    """(offset, length) of each piece a message of nbytes travels in, one slot each."""
    return [(lo, min(slot_bytes, nbytes - lo)) for lo in range(0, nbytes, slot_bytes)]


def ring_bytes(slots: int = SLOTS, slot_bytes: int = SLOT_BYTES) -> int:
    return _HEAD + slots * slot_bytes


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class Ring:
    """One flow's ring over `mem` (ring_bytes() of uint8, shared between the two ends). The
    try_ methods never wait: they are the whole protocol, testable in one process."""

    def __init__(self, mem: torch.Tensor, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        self.mem, self.slots, self.slot_bytes = mem, slots, slot_bytes
        words = mem[:_HEAD].view(torch.int64).view(-1, _LINE // 8)
        self.writer_pid, self.reader_pid = words[_WRITER:_WRITER + 1, 0], words[_READER:_READER + 1, 0]
        self.written_addr, self.read_addr = words[_WRITTEN].data_ptr(), words[_READ].data_ptr()
        # the counters as ctypes views: an aligned 8-byte load or store (atomic on x86-64) for
        # a fraction of a tensor element access, which every poll makes
        self.written = ctypes.c_int64.from_address(self.written_addr)
        self.read = ctypes.c_int64.from_address(self.read_addr)
        self._fence = threading.Lock()

    def _slot(self, k: int, n: int) -> torch.Tensor:
        at = _HEAD + (k % self.slots) * self.slot_bytes
        return self.mem[at:at + n]

    def _publish(self, counter: ctypes.c_int64, value: int, addr: int) -> None:
        with self._fence:  # a locked instruction: the copy's (possibly non-temporal) stores go first
            pass
        counter.value = value
        shm._futex(addr, shm._FUTEX_WAKE, shm._INT_MAX)

    def try_write(self, piece: torch.Tensor) -> bool:
        """Put one piece (uint8, at most slot_bytes) in the next slot, if it is free."""
        k = self.written.value
        if k - self.read.value >= self.slots:
            return False
        self._slot(k, piece.numel()).copy_(piece)
        self._publish(self.written, k + 1, self.written_addr)
        return True

    def try_read(self, out: torch.Tensor) -> bool:
        """Take the next piece into `out` (uint8, its length), if it has been written."""
        k = self.read.value
        if k >= self.written.value:
            return False
        out.copy_(self._slot(k, out.numel()))
        self._publish(self.read, k + 1, self.read_addr)
        return True


@dataclass
class _Outgoing:
    """A message queued on a flow: its bytes (the tensor kept alive) and the pieces not yet written."""

    data: torch.Tensor
    todo: Deque[Tuple[int, int]] = field(default_factory=collections.deque)

    @property
    def done(self) -> bool:
        return not self.todo


class Channel:
    """One flow, seen from one end: the sender's queue, or the receiver's reads."""

    def __init__(self, flow: Flow, ring: Ring, peer_pid: int, sending: bool):
        self.flow, self.ring, self.peer_pid, self.sending = flow, ring, peer_pid, sending
        self.queue: Deque[_Outgoing] = collections.deque()

    def pump(self) -> bool:
        """Write queued pieces while slots are free; whether anything moved."""
        moved = False
        while self.queue:
            msg = self.queue[0]
            while msg.todo:
                lo, n = msg.todo[0]
                if not self.ring.try_write(msg.data[lo:lo + n]):
                    return moved
                msg.todo.popleft()
                moved = True
            self.queue.popleft()
        return moved

    def peer(self) -> int:
        return self.flow[1] if self.sending else self.flow[0]


class PeerGone(shm.PeerExited):
    pass


_lock = threading.RLock()
_out: Dict[Tuple[int, int], Channel] = {}  # (receiver, tag) -> this rank's sending end
_in: Dict[Tuple[int, int], Channel] = {}  # (sender, tag) -> this rank's receiving end


def _pump_all() -> bool:
    moved = False
    for ch in list(_out.values()):
        moved = ch.pump() or moved
    return moved


def _wait(ready, ch: Channel, addr: int, what: str) -> None:
    """Until ready(): move this rank's queued sends meanwhile; spin, yield, then sleep on the
    futex at `addr` (the peer wakes it), a short sleep while sends are still queued here."""
    spins, check = 0, None
    while True:
        _pump_all()
        if ready():
            return
        spins += 1
        if spins < _SPINS:
            continue
        if spins < _SPINS + _YIELDS:
            os.sched_yield()
            continue
        now = time.monotonic()
        if check is None:
            check = now + 1.0
        elif now >= check:
            if not shm._alive(ch.peer_pid):
                raise PeerGone(f"rank {ch.peer()} (pid {ch.peer_pid}) exited during {what} (tag {ch.flow[2]})")
            check = now + 1.0
        queued = any(c.queue for c in _out.values())
        counter = ch.ring.read if addr == ch.ring.read_addr else ch.ring.written
        seen = counter.value  # read before ready(): a move after it makes the futex return at once
        if ready():  # ready() may take what it waits for (a receive's piece): never call it again after True
            return
        shm._futex(addr, shm._FUTEX_WAIT, seen & 0xFFFFFFFF, _MILLI if queued else shm._SECOND)


# A wait polls a few times, then sleeps on the futex. Unlike shm.py's collectives it does not
# yield its core first: on the loaded 2-core machine yielding made a round trip of 8 KiB 5x
# slower than gloo's, polling 8 times and sleeping about gloo's (scripts/bench_p2p.py).
_SPINS, _YIELDS = 8, 0
_MILLI = ctypes.byref(shm._Timespec(0, 200_000))  # 0.2 ms: our own queued sends may have room by then


class _SendWork:
    """isend's handle: done when every piece of its message is in the ring."""

    def __init__(self, ch: Channel, msg: _Outgoing):
        self.ch, self.msg = ch, msg

    def wait(self, timeout=None) -> bool:
        with _lock:
            _wait(lambda: self.msg.done, self.ch, self.ch.ring.read_addr, "isend")
        return True

    def is_completed(self) -> bool:
        with _lock:
            self.ch.pump()
            return self.msg.done

    def is_success(self) -> bool:
        return self.msg.done


# -- the calls comm routes here ----------------------------------------------------------------
# Both ends of a flow must route alike: the choice depends on the flow and the device (CUDA
# tensors go over NCCL on both ends), never on a tensor's layout.
def channel_to(dst: int, tag: int, tensor: torch.Tensor) -> Optional[Channel]:
    if not _out or tensor.device.type != "cpu":
        return None
    return _out.get((dst, tag))


def channel_from(src: int, tag: int, tensor: torch.Tensor) -> Optional[Channel]:
    if not _in or tensor.device.type != "cpu":
        return None
    return _in.get((src, tag))


def isend(ch: Channel, tensor: torch.Tensor) -> _SendWork:
    return _queue(ch, tensor)


def _queue(ch: Channel, tensor: torch.Tensor) -> _SendWork:
    data = as_bytes(tensor.contiguous())
    msg = _Outgoing(data, collections.deque(pieces(data.numel(), ch.ring.slot_bytes)))
    with _lock:
        ch.queue.append(msg)
        _pump_all()
    return _SendWork(ch, msg)


def send(ch: Channel, tensor: torch.Tensor) -> None:
    """Returns once the whole message is in the ring (gloo's returns once it is delivered): the
    sender may then exit, and the receiver still takes it."""
    work = _queue(ch, tensor)
    if not work.msg.done:
        work.wait()


def recv(ch: Channel, tensor: torch.Tensor) -> None:
    into = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    out = as_bytes(into)
    with _lock:
        for lo, n in pieces(out.numel(), ch.ring.slot_bytes):
            piece = out[lo:lo + n]
            _wait(lambda: ch.ring.try_read(piece), ch, ch.ring.written_addr, "recv")
    if into is not tensor:
        tensor.copy_(into)


class _RecvWork:
    """irecv's handle: the pieces are taken as they come, by is_completed() or wait()."""

    def __init__(self, ch: Channel, tensor: torch.Tensor):
        self.tensor = tensor
        self.into = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self.ch, self.out = ch, as_bytes(self.into)
        self.todo = collections.deque(pieces(self.out.numel(), ch.ring.slot_bytes))

    def _take(self) -> bool:
        if not self.todo:
            return True
        while self.todo:
            lo, n = self.todo[0]
            if not self.ch.ring.try_read(self.out[lo:lo + n]):
                return False
            self.todo.popleft()
        if self.into is not self.tensor:
            self.tensor.copy_(self.into)
        return True

    def wait(self, timeout=None) -> bool:
        with _lock:
            _wait(self._take, self.ch, self.ch.ring.written_addr, "irecv")
        return True

    def is_completed(self) -> bool:
        with _lock:
            _pump_all()
            return self._take()

    def is_success(self) -> bool:
        return not self.todo


def irecv(ch: Channel, tensor: torch.Tensor) -> _RecvWork:
    """Taken in order with the flow's other receives: post irecvs in the order they are sent."""
    return _RecvWork(ch, tensor)


def wait_all() -> None:
    """Until every queued send of this rank is in its ring."""
    with _lock:
        for ch in list(_out.values()):
            _wait(lambda: not ch.queue, ch, ch.ring.read_addr, "send")


# -- set-up -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Offer:
    """What one rank tells its group: its host and pid, and the ring it made for each flow it sends."""

    rank: int
    host: str
    pid: int
    rings: Dict[Flow, Tuple[str, bytes]]


def _map(path: str, token: bytes) -> torch.Tensor:
    mem = torch.from_file(path, shared=True, size=ring_bytes(), dtype=torch.uint8)
    if bytes(mem[:_TOKEN].tolist()) != token:
        raise OSError(f"{path}: not the ring its sender made")
    return mem


def agreed(opened: List[Iterable[Flow]]) -> List[Flow]:
    """The flows that go through shared memory: those whose receiver mapped the sender's ring
    (it maps one only on its own host): every rank computes the same list from the exchange."""
    return sorted({tuple(flow) for flows in opened for flow in flows})


def connect(group, sends: Iterable[Tuple[int, int]], recvs: Iterable[Tuple[int, int]]) -> List[Flow]:
    """Collective over `group`: this rank sends on (receiver, tag) flows `sends` and receives on
    (sender, tag) flows `recvs` (global ranks, all inside the group). Sets up a ring for each
    flow whose two ranks share this host's memory and returns the flows that got one (the
    same list on every rank of the group). Flows set up before between the same ranks and tags
    are replaced."""
    from .traffic import host_key

    me = dist.get_rank()
    world = dist.get_world_size(group)
    sends, recvs = sorted(set(sends)), sorted(set(recvs))
    with _lock:  # a flow set up before goes back to gloo unless it gets a ring again now, on both ends
        for key in sends:
            _out.pop(key, None)
        for key in recvs:
            _in.pop(key, None)
    made: Dict[Flow, Tuple[torch.Tensor, int]] = {}  # flow -> (mapping, fd until the receiver has it)
    offer = Offer(me, host_key(), os.getpid(), {})
    if shm.enabled():
        for dst, tag in sends:
            token = secrets.token_bytes(_TOKEN)
            fd = os.memfd_create("dslaunch-p2p", os.MFD_CLOEXEC)
            try:
                os.posix_fallocate(fd, 0, ring_bytes())
                os.pwrite(fd, token, 0)
                path = f"/proc/{os.getpid()}/fd/{fd}"
                made[me, dst, tag] = (_map(path, token), fd)
                offer.rings[me, dst, tag] = (path, token)
            except (OSError, RuntimeError):
                os.close(fd)
    offers: List[Optional[Offer]] = [None] * world
    _c10d.all_gather_object(offers, offer, group=group)
    by_rank = {o.rank: o for o in offers}
    mapped: Dict[Flow, Tuple[torch.Tensor, int]] = {}
    for src, tag in recvs:
        o = by_rank.get(src)
        flow = (src, me, tag)
        if o is None or flow not in o.rings or o.host != offer.host or not shm._alive(o.pid):
            continue
        try:
            mapped[flow] = (_map(*o.rings[flow]), o.pid)
        except (OSError, RuntimeError):
            continue
    opened: List[Optional[List[Flow]]] = [None] * world
    _c10d.all_gather_object(opened, sorted(mapped), group=group)
    for _, fd in made.values():
        os.close(fd)  # the receiver has mapped it (or gave up): the mappings hold the file now
    flows = agreed(opened)
    with _lock:
        for flow in flows:
            src, dst, tag = flow
            if flow in made:
                ring = Ring(made[flow][0])
                ring.writer_pid[0] = os.getpid()
                _out[dst, tag] = Channel(flow, ring, by_rank[dst].pid, sending=True)
            elif flow in mapped:
                ring = Ring(mapped[flow][0])
                ring.reader_pid[0] = os.getpid()
                _in[src, tag] = Channel(flow, ring, mapped[flow][1], sending=False)
    return flows


def forget_all() -> None:
    """Drop every ring (the process groups are being destroyed)."""
    with _lock:
        _out.clear()
        _in.clear()


def buffer_pointers() -> Dict[int, int]:
    """{data pointer: bytes} of every ring this process maps (transport buffers, as shm.py's)."""
    with _lock:
        storages = [ch.ring.mem.untyped_storage() for ch in list(_out.values()) + list(_in.values())]
    return {st.data_ptr(): st.nbytes() for st in storages}
