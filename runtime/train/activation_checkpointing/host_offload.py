"""Moving activations to host memory and back: the bookkeeping behind
`offload_activations.CheckpointHiddenStatesOffload`.

A tensor handed to `offload_input` gets an id. The newest `keep_last_count` of them stay on the
device (the first recomputes of the backward want them at once, before a copy could land); older
ones are copied into a dense host buffer, from a pool keyed by shape and dtype. `restore_input`
(or `_restore_tensor` with caching, for a graph kept with retain_graph) brings one back with its
original strides. With `use_streams` on CUDA the copies run on a side stream, and the device
tensor of the last `max_fwd_stash_count` offloads is held so a quick restore can skip the copy.

Where the device and the host share memory (the CPU) nothing is moved: every tensor counts as
skipped, as DeepSpeed 0.19.8 does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch

from ...core.accelerator import get_accelerator


@dataclass
class CheckpointActivationOffloadStats:
    """What one context saw (reset on entry): DeepSpeed's counters, under DeepSpeed's names."""

    saved_tensors_seen: int = 0  # tensors autograd packed while the hooks were on
    marked_tensors: int = 0  # calls to mark()
    offloaded_tensors: int = 0  # copies started to host memory
    restored_tensors: int = 0  # offloaded tensors brought back (a cached repeat is not counted)
    skipped_marked_tensors: int = 0  # marked tensors left in place (host-resident, small, parameter, overlapping)
    kept_last_tensors: int = 0  # marked tensors the backward found still on the device (keep-last)
    offloaded_bytes: int = 0
    restored_bytes: int = 0


BufferKey = Tuple[Tuple[int, ...], torch.dtype, torch.layout, bool]


class _Offloaded(NamedTuple):
    """One tensor in host memory: the buffer first (DeepSpeed's tests read entry[0])."""

    host: torch.Tensor
    device: torch.device
    shape: torch.Size
    stride: Tuple[int, ...]
    key: BufferKey


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.nelement()


def _check_count(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


class _ActivationOffloadEngine:
    """Offload / restore of single tensors, with keep-last, a host buffer pool and a side stream."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        for name, value in (("keep_last_count", keep_last_count), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("min_offload_bytes", min_offload_bytes)):
            _check_count(name, value)
        self.use_pin_memory = use_pin_memory
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0
        self._tracker: Dict[int, _Offloaded] = {}
        self._keep_last: Dict[int, torch.Tensor] = {}  # insertion order = forward order
        self._fwd_stash: Dict[int, Tuple[torch.Tensor, object]] = {}  # id -> (device tensor, copy-done event)
        self._restored: Dict[int, torch.Tensor] = {}
        self._cpu_buffer_pool: Dict[BufferKey, List[torch.Tensor]] = {}
        self._cpu_buffer_pool_count = 0
        self._pending_cpu_buffers: List[Tuple[BufferKey, torch.Tensor, object]] = []
        # only CUDA has streams; the CPU runs in program order and never offloads anyway
        cuda = not get_accelerator().is_synchronized_device() and torch.cuda.is_available()
        self.s1 = torch.cuda.Stream() if (use_streams and cuda) else None
        self.use_streams = self.s1 is not None

    # -- streams (None: work in program order on the current stream) ------------------------------
    @property
    def compute_stream(self):
        # asked each time: the caller may switch streams after the engine was built
        return torch.cuda.current_stream() if self.use_streams else None

    @staticmethod
    def _stream_context(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # -- what is offloaded ----------------------------------------------------------------------
    def _host_resident(self, tensor: torch.Tensor) -> bool:
        """True when the tensor already lives in memory the host shares (nothing to gain)."""
        accel = get_accelerator()
        return accel.is_synchronized_device() or not accel.on_accelerator(tensor)

    def _should_skip(self, tensor: torch.Tensor) -> bool:
        if self._host_resident(tensor) or _nbytes(tensor) < self.min_offload_bytes:
            return True
        # parameters (and registered buffers) are kept by the module anyway: a copy saves nothing
        if isinstance(tensor, torch.nn.Parameter):
            return True
        buffer_cls = getattr(torch.nn, "Buffer", None)
        if buffer_cls is not None and isinstance(tensor, buffer_cls):
            return True
        # a stride-0 view aliases its elements: rebuilding it with its strides would need the
        # copy to write one element several times
        return tensor.numel() > 1 and 0 in tensor.stride()

    # -- host buffers ---------------------------------------------------------------------------
    def _buffer_key(self, tensor: torch.Tensor) -> BufferKey:
        # host buffers are dense, so only the shape matters, not the source's strides
        return (tuple(tensor.size()), tensor.dtype, tensor.layout, self.use_pin_memory)

    def _pool_cpu_buffer(self, key: BufferKey, buffer: torch.Tensor) -> None:
        if self._cpu_buffer_pool_count < self.max_cpu_buffer_pool_count:
            self._cpu_buffer_pool.setdefault(key, []).append(buffer)
            self._cpu_buffer_pool_count += 1

    def _reap_cpu_buffer_pool(self, force: bool = False) -> None:
        """Return to the pool the buffers whose restore copy has finished (all of them if force)."""
        waiting = []
        for key, buffer, event in self._pending_cpu_buffers:
            if force:
                event.synchronize()
            if force or event.query():
                self._pool_cpu_buffer(key, buffer)
            else:
                waiting.append((key, buffer, event))
        self._pending_cpu_buffers = waiting

    def _empty_cpu_like(self, tensor: torch.Tensor) -> Tuple[torch.Tensor, BufferKey]:
        self._reap_cpu_buffer_pool()
        key = self._buffer_key(tensor)
        free = self._cpu_buffer_pool.get(key)
        if free:
            self._cpu_buffer_pool_count -= 1
            return free.pop(), key
        buffer = torch.empty(key[0], dtype=tensor.dtype, layout=tensor.layout, device="cpu")
        if self.use_pin_memory:
            # through the accelerator, so the pinned-memory total counts it
            buffer = get_accelerator().pin_memory(buffer)
        return buffer, key

    # -- offload --------------------------------------------------------------------------------
    def _drop_stash_before(self, newest_id: int) -> None:
        # the side stream keeps the memory alive until its copy ends (record_stream): only the
        # last max_fwd_stash_count device tensors are held for a restore without a copy
        for tensor_id in [i for i in self._fwd_stash if i <= newest_id - self.max_fwd_stash_count]:
            del self._fwd_stash[tensor_id]

    def _start_offload(self, tensor_id: int, tensor: torch.Tensor, newest_id: Optional[int] = None) -> None:
        stream = None
        if self.use_streams:
            self._drop_stash_before(tensor_id if newest_id is None else newest_id)
            stream = self.s1
            stream.wait_stream(self.compute_stream)
        with self._stream_context(stream):
            buffer, key = self._empty_cpu_like(tensor)
            buffer.copy_(tensor.detach(), non_blocking=self.use_streams)
        self._tracker[tensor_id] = _Offloaded(buffer, tensor.device, tensor.size(), tuple(tensor.stride()), key)
        if self.use_streams:
            tensor.record_stream(stream)
            if self.max_fwd_stash_count > 0:
                self._fwd_stash[tensor_id] = (tensor, stream.record_event())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(buffer)

    def offload_input(self, tensor: torch.Tensor) -> Optional[int]:
        """Take `tensor` in; its id, or None when it is skipped (then the caller keeps it)."""
        if self._should_skip(tensor):
            self.stats.skipped_marked_tensors += 1
            return None
        self._next_id += 1
        newest = self._next_id
        self._keep_last[newest] = tensor
        while len(self._keep_last) > self.keep_last_count:
            oldest = next(iter(self._keep_last))
            self._start_offload(oldest, self._keep_last.pop(oldest), newest_id=newest)
        return newest

    # -- restore --------------------------------------------------------------------------------
    def restore_input(self, tensor_id: int) -> torch.Tensor:
        """The tensor behind `tensor_id`, once (the id is forgotten)."""
        return self._restore_tensor(tensor_id, cache=False)

    def _restore_tensor(self, tensor_id: int, cache: bool = True) -> torch.Tensor:
        # cache: a graph kept with retain_graph unpacks the same id again; the answer is kept
        # until the context ends
        if cache and tensor_id in self._restored:
            return self._restored[tensor_id]
        restored = self._bring_back(tensor_id)
        if cache:
            self._restored[tensor_id] = restored
        return restored

    def _bring_back(self, tensor_id: int) -> torch.Tensor:
        if tensor_id in self._keep_last:
            self.stats.kept_last_tensors += 1
            return self._keep_last.pop(tensor_id)
        entry = self._tracker.pop(tensor_id, None)
        if entry is None:
            raise RuntimeError(f"offloaded activation {tensor_id} is no longer tracked: run backward() before "
                               "the offload context ends or is reset")
        if tensor_id in self._fwd_stash:
            # still held on the device: wait for its offload copy, then use it as it is
            tensor, event = self._fwd_stash.pop(tensor_id)
            self.compute_stream.wait_event(event)
            self._pool_cpu_buffer(entry.key, entry.host)
            self._count_restore(tensor)
            return tensor
        stream = self.s1 if self.use_streams else None
        with self._stream_context(stream):
            # a fresh tensor with the source's strides at offset 0 (the dense buffer has no offset)
            tensor = torch.empty_strided(entry.shape, entry.stride, dtype=entry.host.dtype, device=entry.device)
            tensor.copy_(entry.host, non_blocking=self.use_streams)
        if self.use_streams:
            done = stream.record_event()
            self.compute_stream.wait_event(done)
            tensor.record_stream(self.compute_stream)
            self._pending_cpu_buffers.append((entry.key, entry.host, done))  # pooled once the copy ends
        else:
            self._pool_cpu_buffer(entry.key, entry.host)
        self._count_restore(tensor)
        return tensor

    def _count_restore(self, tensor: torch.Tensor) -> None:
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(tensor)

    # -- ends -----------------------------------------------------------------------------------
    def _wait_for_copies(self) -> None:
        if self.use_streams:
            self.s1.synchronize()
            self._reap_cpu_buffer_pool(force=True)

    def _forget(self) -> None:
        self._tracker.clear()
        self._fwd_stash.clear()
        self._keep_last.clear()
        self._restored.clear()
        self._pending_cpu_buffers.clear()

    def reset(self) -> None:
        """Forget every tensor and zero the stats (copies in flight are waited for first)."""
        self._wait_for_copies()
        self._forget()
        self.stats = CheckpointActivationOffloadStats()
        self._next_id = 0

    def _sync_and_clear(self) -> None:
        """At the end of a context: buffers of tensors never restored go back to the pool."""
        self._wait_for_copies()
        for entry in self._tracker.values():
            self._pool_cpu_buffer(entry.key, entry.host)
        self._forget()
