"""Collectives through shared memory, for process groups whose ranks share one host's memory.

gloo moves a CPU tensor between two processes on one machine through loopback TCP: the
bytes are copied into the kernel and out again, and each op wakes gloo's own threads on
both sides. Here every rank of the group maps one shared segment; a collective copies this
rank's tensor into its region of the segment, waits until every rank's counter in the
segment says it has done the same, and reads the others' regions directly (one copy in,
one out, no thread of anyone else to wake). On the 2-core benchmark machine that is 2.4-3.9x
less time than gloo for the megabyte-sized buckets ZeRO moves (scripts/bench_comm.py).

Which groups: decided once per group, at its first collective that could go this way, by
all of its ranks together (all_gather_object over the group, so every rank takes the same
path): the group's rank 0 creates the segment as an anonymous file (memfd_create) with a
random token and reserves its pages (posix_fallocate: no room is an error now, not a SIGBUS
later); every rank opens it through /proc/<rank 0's pid>/fd/<fd>, maps it, and checks the
token and that it sees every peer's pid; only when every rank could, and every rank names the
same host (traffic.host_key: the launcher's NODE_RANK, else the hostname), the group uses it.
DSLAUNCH_SHM_COMM must therefore be the same on every rank, as launchers set it. The file
has no name, so nothing is left behind however a rank ends. Ranks on different hosts (or in
other pid namespaces) fail the check and the group stays on gloo; so do "hosts" that are
network namespaces of one machine (tests/testbed.py), which could map each other's memory
but stand for machines that cannot.

Which calls: all_reduce, reduce, all_gather_into_tensor, reduce_scatter_tensor and
all_to_all_single with even splits (no split sizes given) on CPU tensors of a gloo group, of
at least MIN_BYTES (below that gloo's latency is as good), in float32/64, bfloat16, float16,
int32 or int64, with SUM, MAX or MIN. Everything decides on what every rank passes alike
(sizes, dtypes, op), so all ranks of a group agree on the path: uneven all-to-alls stay on
gloo, since one rank's split sizes may be even where another's are not.
Sums run in group-rank order in the tensor's dtype: with two ranks that is bit for bit
gloo's result (a + b == b + a); with more it can differ from gloo's ring in the last bit.

Synchronisation: each rank's counter lives on its own cache line; a wait polls briefly,
yields its core a few hundred times (a rank queued behind it runs), then sleeps in the
kernel on the counter of the rank it waits for (futex(2)), which that rank wakes when it
counts in: ranks that oversubscribe the cores do not take the time of the rank they wait
for, and no wake-up comes late. Data is written before the counter
and read after it: x86-64 keeps stores in order and loads in order, which is what makes
that safe, so the transport is used on x86-64 only. Regions alternate between two halves
by the parity of the wait that publishes them: a region is written again two waits later,
when every reader of its last contents has passed the wait in between.

A peer that exits mid-collective (its pid is in the segment, checked every second of
waiting) makes the wait raise, as gloo's broken connection would; a peer that hangs is the
collective watchdog's (the op is in the flight record like any other).
DSLAUNCH_SHM_COMM=0 keeps every group on gloo.
"""
from __future__ import annotations

import ctypes
import os
import platform
import secrets
import threading
import time
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d  # set-up exchanges: not the job's collectives

ENV = "DSLAUNCH_SHM_COMM"
MIN_BYTES = 32 * 1024
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
_LINE = 64  # bytes: one counter per cache line, so ranks do not write the same line
_TOKEN = 16
_BUDGET = 16 << 20  # bytes of shared memory per group at most (the data regions and results)
_REGION_MAX = 1 << 20  # as fast as 4 MiB for megabyte buckets here; 512 KiB was 3x slower


def _ops():
    R = dist.ReduceOp
    return {R.SUM: torch.add, R.MAX: torch.maximum, R.MIN: torch.minimum}


def region_bytes(world: int) -> int:
    """Bytes per rank and half: 1 MiB, less for large groups so a group takes at most _BUDGET
    (two halves of `world` regions, plus two result regions), rounded to cache lines."""
    per = min(_REGION_MAX, _BUDGET // (2 * world + 2))
    return max(_LINE, per // _LINE * _LINE)


class PeerExited(RuntimeError):
    """A rank of the group exited while this one waited for it in a collective."""


class Segment:
    """One group's shared segment and its collectives (every method is a collective)."""

    def __init__(self, path: str, token: bytes, rank: int, world: int, ranks: Tuple[int, ...], name: str,
                 create: bool):
        self.rank, self.world, self.ranks, self.name = rank, world, ranks, name
        self.region = region_bytes(world)
        head = _LINE + 2 * world * _LINE  # token; a counter per rank; a pid per rank
        self.size = head + 2 * world * self.region + 2 * self.region
        self.fd = None
        if create:  # an anonymous file: it has no name to leave behind, whoever dies when
            self.fd = os.memfd_create("dslaunch-comm", os.MFD_CLOEXEC)
            try:
                os.posix_fallocate(self.fd, 0, self.size)
                os.pwrite(self.fd, token, 0)
            except OSError:
                self.close_fd()
                raise
            path = f"/proc/{os.getpid()}/fd/{self.fd}"  # how the other ranks open it too
        mem = torch.from_file(path, shared=True, size=self.size, dtype=torch.uint8)
        if bytes(mem[:_TOKEN].tolist()) != token:
            raise OSError(f"{path}: not the segment rank 0 made")
        self.mem = mem
        words = mem[:head].view(torch.int64).view(-1, _LINE // 8)
        self.counters = words[1:1 + world, 0]
        self.counters_ptr = self.counters.data_ptr()  # futexes wait on the low 32 bits of each
        self.pids = words[1 + world:1 + 2 * world, 0]
        self.pids[rank] = os.getpid()
        self.data_at = head
        self.result_at = head + 2 * world * self.region
        self.seq = 0
        self.lock = threading.Lock()
        self._fence = threading.Lock()
        self.path = path

    def close_fd(self) -> None:
        """Rank 0 keeps the file open until every rank has mapped it; then the mappings hold it."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # -- layout ------------------------------------------------------------------------------
    def _data(self, half: int, rank: int, dtype, n: int) -> torch.Tensor:
        at = self.data_at + (half * self.world + rank) * self.region
        return self.mem[at:at + n * dtype.itemsize].view(dtype)

    def _result(self, half: int, dtype, n: int) -> torch.Tensor:
        at = self.result_at + half * self.region
        return self.mem[at:at + n * dtype.itemsize].view(dtype)

    def _next_half(self) -> int:
        return (self.seq + 1) & 1  # the half the next wait publishes

    # -- waiting -----------------------------------------------------------------------------
    def wait_all(self, what: str) -> None:
        """Count this rank in; return once every rank of the group has come this far."""
        self.seq += 1
        k = self.seq
        # A locked instruction (taking an uncontended lock) before the counter: x86 keeps ordinary
        # stores in order, but a large copy may use non-temporal stores, which only a fence or a
        # locked instruction orders before the counter's store.
        with self._fence:
            pass
        self.counters[self.rank] = k
        _futex(self._addr(self.rank), _FUTEX_WAKE, _INT_MAX)
        spins, check = 0, None
        while True:
            now_at = self.counters.tolist()  # one read of every counter: the check and the wait agree
            seen = min(now_at)
            if seen >= k:
                return
            behind = now_at.index(seen)
            spins += 1
            if spins < _SPINS:
                continue
            if spins < _SPINS + _YIELDS:  # the peer is usually on another core and nearly there
                os.sched_yield()
                continue
            now = time.monotonic()
            if check is None:
                check = now + 1.0
            elif now >= check:
                self._check_peers(k, what)
                check = now + 1.0
            # sleep in the kernel until the rank behind moves its counter (it wakes us), or a
            # second passes (then see whether it is still alive)
            _futex(self._addr(behind), _FUTEX_WAIT, seen & 0xFFFFFFFF, _SECOND)

    def _addr(self, rank: int) -> int:
        return self.counters_ptr + rank * _LINE

    def _check_peers(self, k: int, what: str) -> None:
        for r in range(self.world):
            if int(self.counters[r]) >= k:
                continue
            pid = int(self.pids[r])
            if not _alive(pid):
                raise PeerExited(f"rank {self.ranks[r]} (pid {pid}) of group {self.name} exited during {what}")

    # -- collectives -------------------------------------------------------------------------
    def _chunks(self, total: int, step: int):
        """(offset, length, half) of each piece of `total` elements at most `step` long: the
        half is the one the piece's first wait publishes, which the caller copies into."""
        step = max(1, step)
        for lo in range(0, total, step):
            yield lo, min(step, total - lo), self._next_half()

    def all_reduce(self, t: torch.Tensor, op) -> None:
        combine = _ops()[op]
        flat = t.view(-1)
        for lo, n, half in self._chunks(flat.numel(), self.region // t.element_size()):
            chunk = flat[lo:lo + n]
            self._data(half, self.rank, t.dtype, n).copy_(chunk)
            self.wait_all("all_reduce")
            # each rank combines its slice of the chunk into the result region of this half
            per = -(-n // self.world)
            a, b = min(n, self.rank * per), min(n, (self.rank + 1) * per)
            if a < b:
                out = self._result(half, t.dtype, n)[a:b]
                combine(self._data(half, 0, t.dtype, n)[a:b], self._data(half, 1, t.dtype, n)[a:b], out=out)
                for r in range(2, self.world):
                    combine(out, self._data(half, r, t.dtype, n)[a:b], out=out)
            self.wait_all("all_reduce")
            chunk.copy_(self._result(half, t.dtype, n))

    def reduce(self, t: torch.Tensor, dst: int, op) -> None:
        combine = _ops()[op]
        flat = t.view(-1)
        for lo, n, half in self._chunks(flat.numel(), self.region // t.element_size()):
            chunk = flat[lo:lo + n]
            self._data(half, self.rank, t.dtype, n).copy_(chunk)
            self.wait_all("reduce")
            if self.rank == dst:
                combine(self._data(half, 0, t.dtype, n), self._data(half, 1, t.dtype, n), out=chunk)
                for r in range(2, self.world):
                    combine(chunk, self._data(half, r, t.dtype, n), out=chunk)

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        src, rows = inp.reshape(-1), out.view(self.world, -1)
        for lo, n, half in self._chunks(src.numel(), self.region // inp.element_size()):
            self._data(half, self.rank, inp.dtype, n).copy_(src[lo:lo + n])
            self.wait_all("all_gather_into_tensor")
            for r in range(self.world):
                rows[r, lo:lo + n].copy_(self._data(half, r, inp.dtype, n))

    def _blocks(self, half: int, rank: int, dtype, n: int) -> torch.Tensor:
        """Rank `rank`'s region of `half` as `world` rows of n elements: row r is meant for group rank r."""
        return self._data(half, rank, dtype, self.world * n).view(self.world, n)

    def _scatter_in(self, inp: torch.Tensor, what: str):
        """Copy block r of `inp` (its r-th 1/world) into row r of this rank's region, chunk by
        chunk; yields (offset, length, half) once every rank's rows of that chunk are in."""
        blocks = inp.reshape(self.world, -1)
        step = self.region // (inp.element_size() * self.world)
        for lo, n, half in self._chunks(blocks.shape[1], step):
            self._blocks(half, self.rank, inp.dtype, n).copy_(blocks[:, lo:lo + n])
            self.wait_all(what)
            yield lo, n, half

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op) -> None:
        combine = _ops()[op]
        dst = out.view(-1)
        for lo, n, half in self._scatter_in(inp, "reduce_scatter_tensor"):
            mine = [self._blocks(half, r, inp.dtype, n)[self.rank] for r in range(self.world)]
            combine(mine[0], mine[1], out=dst[lo:lo + n])
            for r in range(2, self.world):
                combine(dst[lo:lo + n], mine[r], out=dst[lo:lo + n])

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Even splits: block r of `inp` (its r-th 1/world) goes to group rank r, and block r
        of `out` comes from group rank r."""
        rows = out.view(self.world, -1)
        for lo, n, half in self._scatter_in(inp, "all_to_all_single"):
            for r in range(self.world):
                rows[r, lo:lo + n].copy_(self._blocks(half, r, inp.dtype, n)[self.rank])


# futex(2) on the counters: a waiting rank sleeps in the kernel and the rank it waits for
# wakes it when it counts in (the memory is shared, so the futex is too: no FUTEX_PRIVATE).
_FUTEX_WAIT, _FUTEX_WAKE, _INT_MAX = 0, 1, 2 ** 31 - 1
# Before sleeping a wait polls, then yields the core (to a rank queued on it) this many times:
# a futex sleep and wake-up costs ~0.2 ms here, more than a peer on another core takes to arrive.
_SPINS, _YIELDS = 64, 256
_SYS_FUTEX = 202  # x86-64


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SECOND = ctypes.byref(_Timespec(1, 0))
_libc = ctypes.CDLL(None, use_errno=True)  # calls release the GIL while the kernel sleeps
_libc.syscall.restype = ctypes.c_long


def _futex(addr: int, op: int, val: int, timeout=None) -> None:
    _libc.syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(op), ctypes.c_int(val),
                  timeout, None, ctypes.c_int(0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except (OSError, IndexError):
        return True  # no /proc to ask: the pid exists


# -- which group uses a segment ------------------------------------------------------------------
# id(group) -> [the group, its segment or None]: a list, which the exit sequence's sweep of
# destroyed groups (shutdown.py) can empty, so a dead gloo group is not kept alive from here
_segments: Dict[int, list] = {}
_setup_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")


def fits(*tensors, op=None) -> bool:
    """Whether a collective on these tensors (and reduction op) would go through a group's
    segment: depends only on what every rank passes alike, so all ranks agree."""
    if not enabled() or (op is not None and op not in _ops()):
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in _DTYPES or t.is_sparse or not t.is_contiguous():
            return False
    return tensors[0].numel() * tensors[0].element_size() >= MIN_BYTES


def segment(group) -> Optional[Segment]:
    """The group's segment, or None when it has none (it stays on gloo). The first call on a
    group sets it up with the group's other ranks (see the module docstring): every rank of
    the group must make it, as it makes the collective it is for."""
    g = group if group is not None else dist.group.WORLD
    found = _segments.get(id(g))
    if found is not None and found[0] is g:
        return found[1]
    with _setup_lock:
        seg = _setup(g)
        _segments[id(g)] = [g, seg]  # the group is kept, so its id cannot be reused while here
    return seg


def segment_for(group, *tensors, op=None) -> Optional[Segment]:
    """The segment a collective on these tensors would use, or None (gloo)."""
    return segment(group) if fits(*tensors, op=op) else None


def _setup(group) -> Optional[Segment]:
    if dist.get_backend(group) != "gloo":
        return None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = tuple(dist.get_process_group_ranks(group))
    from .groups import group_name

    name = group_name(group)
    offer = None
    if rank == 0:
        token = secrets.token_bytes(_TOKEN)
        try:
            seg = Segment("", token, rank, world, ranks, name, create=True)
            offer = (seg.path, token)
        except (OSError, RuntimeError):
            seg = None
    from .traffic import host_key

    seen = [None] * world
    _c10d.all_gather_object(seen, (offer, os.getpid(), host_key()), group=group)
    path, token = seen[0][0] if seen[0][0] is not None else (None, None)
    if rank != 0:
        seg = None
        if path is not None:
            try:
                seg = Segment(path, token, rank, world, ranks, name, create=False)
            except (OSError, RuntimeError):
                seg = None
    # every peer's pid must be one this rank sees (not another pid namespace),
    # or a live peer would be taken for one that exited
    ok = [None] * world
    one_host = len({host for _, _, host in seen}) == 1
    _c10d.all_gather_object(ok, seg is not None and one_host and all(_alive(pid) for _, pid, _ in seen), group=group)
    if rank == 0 and seg is not None:
        seg.close_fd()  # every rank has it mapped (or gave up)
    return seg if all(ok) else None


def buffer_pointers() -> Dict[int, int]:
    """{data pointer: bytes} of every segment this process maps: transport buffers (as NCCL's
    and gloo's own, which no tensor shows), left out where live tensor bytes are counted."""
    storages = (entry[1].mem.untyped_storage() for entry in list(_segments.values()) if entry[1] is not None)
    return {st.data_ptr(): st.nbytes() for st in storages}


def forget(group) -> None:
    """Drop a group's segment (the group is being destroyed)."""
    g = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    _segments.pop(id(g), None)


def forget_all() -> None:
    _segments.clear()
