"""Every collective of the runtime, in one place.

Signatures are torch.distributed's (and deepspeed.comm's), plus keyword options:
  label=      what the caller is doing ("stage3 gather blocks.2 (forward)"): it goes into
              the flight record, so a hang report says which collective of which layer
  prof=, log_name=, debug=   DeepSpeed's comms-logger options (logger.py)
  labelled(text)  a `with` block giving that label to the collectives inside it that pass
              none: for a caller that calls in deepspeed.comm's exact signature (DeepSpeed's
              tests replace some functions with ones of that signature)
Roots of rooted collectives are global ranks (`src`, `dst`) or ranks within the group
(`group_src`, `group_dst`), as in torch.distributed.

Each call: counts a sequence number for its group and records op, group, bytes and label
(flight.py); makes sure this process's watchdog runs (watchdog.py); times the op when the
comms logger profiles it; hands async handles to the exit handler so they are waited for.
Without torch.distributed, or on a group of one, each op does its one-process meaning
(copy, or nothing) and records nothing.

reduce_scatter_tensor / all_gather_into_tensor use the backend's native collective when it
has one; older gloo builds lack them (some fail only when called), so the first failure
switches this process to equivalents built from all_reduce / all_gather (more bytes, same
result). The switch is sticky and every rank hits the same failure on the same call, so all
ranks switch together. Sizes and ranks always come from the group, never from the world.

torch.distributed's functions are looked up at call time (tests wrap them to count calls).
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from . import shm, shm_p2p, shutdown, watchdog
from .flight import FlightRecorder
from .groups import get_all_ranks_from_group, get_global_rank, get_rank, get_world_size, group_name, is_initialized
from .logger import CommsLogger

ReduceOp = dist.ReduceOp
recorder = FlightRecorder()
comms_logger = CommsLogger()
_native_ok = {"reduce_scatter": True, "all_gather": True}


def _native(*names) -> Optional[Callable]:
    # torch 2.13 renamed the tensor collectives (*_single) and warns on the old names
    for n in names:
        fn = getattr(dist, n, None)
        if fn is not None:
            return fn
    return None


def _nbytes(*tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
        elif isinstance(t, (list, tuple)):
            total += _nbytes(*t)
    return total


def _caller() -> str:
    f = inspect.currentframe()
    for _ in range(3):  # _run <- the op <- its caller
        f = f.f_back if f is not None else None
    return f.f_code.co_name if f is not None else "?"


_SCOPE_LABEL: contextvars.ContextVar = contextvars.ContextVar("collective_label", default=None)


@contextlib.contextmanager
def labelled(text: str):
    """The label of every collective inside the block that passes none (see the module docstring)."""
    token = _SCOPE_LABEL.set(text)
    try:
        yield
    finally:
        _SCOPE_LABEL.reset(token)


def scope_label() -> Optional[str]:
    """The label `labelled` gives collectives here, or None outside such a block."""
    return _SCOPE_LABEL.get()


def _run(op: str, group, nbytes: int, call: Callable[[], Any], async_op: bool, label: Optional[str],
         prof: bool = False, log_name: Optional[str] = None, debug: Optional[str] = None, group_key=None,
         device_tensor: Optional[torch.Tensor] = None):
    """Record, run, time and track one collective (see the module docstring)."""
    watchdog.ensure(recorder)
    shutdown.prune_works()
    gname = group_name(group)
    if group_key is None:
        group_key = None if gname == "world" else id(group)  # None and group.WORLD count together
    entry = recorder.begin(op, group_key, gname, nbytes, label or scope_label() or "")
    name = log_name or op
    profile = comms_logger.wants(name, prof)
    start = time.perf_counter()
    try:
        work = call()
        if profile:
            if async_op and work is not None:
                work.wait()
            if device_tensor is not None and device_tensor.is_cuda:
                torch.cuda.synchronize(device_tensor.device)
            comms_logger.record(name, op, nbytes, time.perf_counter() - start, gname, get_world_size(group),
                                debug or (_caller() if comms_logger.debug else None))
            peer = group_key[2] if isinstance(group_key, tuple) and group_key[:1] == ("p2p",) else None
            comms_logger.traffic.record(op, gname, nbytes, get_rank(), get_all_ranks_from_group(group), peer)
            recorder.end(entry)
        elif async_op and work is not None:
            recorder.end(entry, work)
            shutdown.track_work(work)
        else:
            recorder.end(entry)
    except Exception as exc:
        recorder.fail(entry, exc)
        raise
    return work


def release_completed() -> None:
    """Drop the handles of completed async collectives now (each keeps its tensors alive until
    the next collective otherwise): a caller that waited for its buffers frees them at once."""
    recorder.release_finished()
    shutdown.prune_works()


class _Done:
    """The handle an async op returns when there was nothing to communicate."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _local(async_op: bool):
    return _Done() if async_op else None


def _solo(group) -> bool:
    return not is_initialized() or get_world_size(group) == 1


def _shm_or(group, method: str, args: tuple, fallback: Callable[[], Any], async_op: bool) -> Callable[[], Any]:
    """The call _run makes for a collective that shm.fits: through the group's shared segment
    (shm.py), or `fallback` (gloo) where the group has none. The first such call on a group
    sets its segment up with the group's other ranks in here, inside the recorded op, so a
    rank that never arrives is the watchdog's like any other. Through the segment the op is
    done when it returns: an async caller gets a handle that is already complete."""
    def call():
        seg = shm.segment(group)
        if seg is None:
            return fallback()
        with seg.lock:
            getattr(seg, method)(*args)
        return _local(async_op)
    return call


def _group_rank(group, global_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return global_rank
    return dist.get_group_rank(group, global_rank)


# -- reductions ------------------------------------------------------------------------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, label=None, prof=False, log_name=None,
               debug=None):
    if _solo(group):
        return _local(async_op)
    def call():
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    if shm.fits(tensor, op=op):
        call = _shm_or(group, "all_reduce", (tensor, op), call, async_op)
    return _run("all_reduce", group, _nbytes(tensor), call, async_op, label, prof, log_name, debug,
                device_tensor=tensor)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, label=None, prof=False,
                         log_name=None, debug=None):
    return all_reduce(tensor, op, group, async_op, label, prof, log_name or "inference_all_reduce", debug)


def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None, label=None, prof=False,
           log_name=None, debug=None):
    if _solo(group):
        return _local(async_op)
    def call():
        return dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op, group_dst=group_dst)

    if shm.fits(tensor, op=op):
        root = group_dst if group_dst is not None else _group_rank(group, dst)
        call = _shm_or(group, "reduce", (tensor, root, op), call, async_op)
    return _run("reduce", group, _nbytes(tensor), call, async_op, label, prof, log_name, debug,
                device_tensor=tensor)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, label=None, prof=False,
                          log_name=None, debug=None):
    """output <- the reduction over the group of input[r*n:(r+1)*n], r this rank's rank in
    the group, n = output.numel()."""
    if _solo(group):
        output.copy_(input.view(-1)[:output.numel()].view_as(output))
        return _local(async_op)

    def call():
        native = _native("reduce_scatter_single", "reduce_scatter_tensor")
        if _native_ok["reduce_scatter"] and native is not None:
            try:
                return native(output, input, op=op, group=group, async_op=async_op)
            except (RuntimeError, NotImplementedError, ValueError):
                _native_ok["reduce_scatter"] = False
        buf = input.clone()
        dist.all_reduce(buf, op=op, group=group)
        r, n = get_rank(group), output.numel()
        output.copy_(buf.view(-1)[r * n:(r + 1) * n].view_as(output))
        return _local(async_op)

    if shm.fits(output, input, op=op) and input.numel() == get_world_size(group) * output.numel():
        call = _shm_or(group, "reduce_scatter", (output, input, op), call, async_op)
    return _run("reduce_scatter_tensor", group, _nbytes(input), call, async_op, label, prof, log_name, debug,
                device_tensor=output)


reduce_scatter_fn = reduce_scatter_tensor


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False, label=None, prof=False,
                   log_name=None, debug=None):
    if _solo(group):
        output.copy_(input_list[0])
        return _local(async_op)
    return _run("reduce_scatter", group, _nbytes(input_list),
                lambda: dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op), async_op,
                label, prof, log_name, debug, device_tensor=output)


# -- gathers and broadcasts --------------------------------------------------------------------
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, label=None, prof=False,
                           log_name=None, debug=None):
    """output_tensor <- every group rank's input_tensor concatenated, in group-rank order."""
    if _solo(group):
        output_tensor.view(-1)[:input_tensor.numel()].copy_(input_tensor.view(-1))
        return _local(async_op)

    def call():
        native = _native("all_gather_single", "all_gather_into_tensor")
        if _native_ok["all_gather"] and native is not None:
            try:
                return native(output_tensor, input_tensor, group=group, async_op=async_op)
            except (RuntimeError, NotImplementedError, ValueError):
                _native_ok["all_gather"] = False
        dist.all_gather(list(output_tensor.view(-1).chunk(get_world_size(group))), input_tensor.view(-1), group=group)
        return _local(async_op)

    if shm.fits(input_tensor, output_tensor) and output_tensor.numel() == get_world_size(group) * input_tensor.numel():
        call = _shm_or(group, "all_gather_into", (output_tensor, input_tensor), call, async_op)
    return _run("all_gather_into_tensor", group, _nbytes(output_tensor), call, async_op, label, prof, log_name,
                debug, device_tensor=output_tensor)


allgather_fn = all_gather_into_tensor


def all_gather(tensor_list, tensor, group=None, async_op=False, label=None, prof=False, log_name=None, debug=None):
    if _solo(group):
        tensor_list[0].copy_(tensor)
        return _local(async_op)
    return _run("all_gather", group, _nbytes(tensor_list),
                lambda: dist.all_gather(tensor_list, tensor, group=group, async_op=async_op), async_op, label, prof,
                log_name, debug, device_tensor=tensor)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, label=None, prof=False, log_name=None,
              debug=None):
    if _solo(group):
        return _local(async_op)
    return _run("broadcast", group, _nbytes(tensor),
                lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src),
                async_op, label, prof, log_name, debug, device_tensor=tensor)


def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None, label=None, prof=False,
           log_name=None, debug=None):
    if _solo(group):
        if gather_list:
            gather_list[0].copy_(tensor)
        return _local(async_op)
    return _run("gather", group, _nbytes(tensor) * get_world_size(group),
                lambda: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op,
                                    group_dst=group_dst), async_op, label, prof, log_name, debug,
                device_tensor=tensor)


def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None, label=None, prof=False,
            log_name=None, debug=None):
    if _solo(group):
        if scatter_list:
            tensor.copy_(scatter_list[0])
        return _local(async_op)
    return _run("scatter", group, _nbytes(tensor) * get_world_size(group),
                lambda: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op,
                                     group_src=group_src), async_op, label, prof, log_name, debug,
                device_tensor=tensor)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False,
                      label=None, prof=False, log_name=None, debug=None):
    if _solo(group):
        output.copy_(input)
        return _local(async_op)
    def call():
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                      async_op=async_op)

    # even splits only: those every rank passes alike (see shm.py)
    if output_split_sizes is None and input_split_sizes is None and shm.fits(output, input) \
            and input.dim() > 0 and input.shape[0] % get_world_size(group) == 0 and output.numel() == input.numel():
        call = _shm_or(group, "all_to_all", (output, input), call, async_op)
    return _run("all_to_all_single", group, _nbytes(input), call, async_op, label, prof, log_name, debug,
                device_tensor=output)


def all_gather_object(object_list: List[Any], obj, group=None, label=None, prof=False, log_name=None, debug=None):
    """object_list[r] <- group rank r's obj (picklable)."""
    if _solo(group):
        object_list[0] = obj
        return None
    return _run("all_gather_object", group, 0, lambda: dist.all_gather_object(object_list, obj, group=group), False,
                label, prof, log_name, debug)


def broadcast_object_list(object_list: List[Any], src=None, group=None, device=None, group_src=None, label=None,
                          prof=False, log_name=None, debug=None):
    if _solo(group):
        return None
    return _run("broadcast_object_list", group, 0,
                lambda: dist.broadcast_object_list(object_list, src=src, group=group, device=device,
                                                   group_src=group_src), False, label, prof, log_name, debug)


# -- synchronisation ------------------------------------------------------------------------
def barrier(group=None, async_op=False, device_ids=None, label=None, prof=False, log_name=None, debug=None):
    if _solo(group):
        return _local(async_op)
    return _run("barrier", group, 0, lambda: dist.barrier(group=group, async_op=async_op, device_ids=device_ids),
                async_op, label, prof, log_name, debug)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False, label=None, prof=False, log_name=None,
                      debug=None):
    """gloo's barrier that names the ranks that did not arrive within `timeout`."""
    if _solo(group):
        return None
    return _run("monitored_barrier", group, 0,
                lambda: dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks), False,
                label, prof, log_name, debug)


# -- point to point (the pipeline's activations and gradients) -------------------------------
def _p2p(op: str, tensor, peer, group, group_peer, async_op: bool, label, prof, log_name, debug, call):
    who = peer if peer is not None else get_global_rank(group, group_peer)
    return _run(op, group, _nbytes(tensor), call, async_op, label or f"peer {who}", prof, log_name, debug,
                group_key=("p2p", group_name(group), who), device_tensor=tensor)


def _peer(peer, group, group_peer) -> int:
    return peer if peer is not None else get_global_rank(group, group_peer)


# A flow shm_p2p.connect() set up between two ranks of one host goes through its ring on both
# ends (the receiver's recv and the sender's send route alike: both look the flow up by peer and tag).
def send(tensor, dst=None, group=None, tag=0, group_dst=None, label=None, prof=False, log_name=None, debug=None):
    ch = shm_p2p.channel_to(_peer(dst, group, group_dst), tag, tensor)
    return _p2p("send", tensor, dst, group, group_dst, False, label, prof, log_name, debug,
                (lambda: shm_p2p.send(ch, tensor)) if ch is not None else
                (lambda: dist.send(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)))


def recv(tensor, src=None, group=None, tag=0, group_src=None, label=None, prof=False, log_name=None, debug=None):
    ch = shm_p2p.channel_from(_peer(src, group, group_src), tag, tensor)
    return _p2p("recv", tensor, src, group, group_src, False, label, prof, log_name, debug,
                (lambda: shm_p2p.recv(ch, tensor)) if ch is not None else
                (lambda: dist.recv(tensor, src=src, group=group, tag=tag, group_src=group_src)))


def isend(tensor, dst=None, group=None, tag=0, group_dst=None, label=None, prof=False, log_name=None, debug=None):
    ch = shm_p2p.channel_to(_peer(dst, group, group_dst), tag, tensor)
    return _p2p("isend", tensor, dst, group, group_dst, True, label, prof, log_name, debug,
                (lambda: shm_p2p.isend(ch, tensor)) if ch is not None else
                (lambda: dist.isend(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)))


def irecv(tensor, src=None, group=None, tag=0, group_src=None, label=None, prof=False, log_name=None, debug=None):
    ch = shm_p2p.channel_from(_peer(src, group, group_src), tag, tensor)
    return _p2p("irecv", tensor, src, group, group_src, True, label, prof, log_name, debug,
                (lambda: shm_p2p.irecv(ch, tensor)) if ch is not None else
                (lambda: dist.irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)))


def has_all_gather_into_tensor() -> bool:
    return _native("all_gather_single", "all_gather_into_tensor") is not None and _native_ok["all_gather"]


def has_reduce_scatter_tensor() -> bool:
    return _native("reduce_scatter_single", "reduce_scatter_tensor") is not None and _native_ok["reduce_scatter"]


def force_fallback(enabled: bool = True, which: Optional[str] = None) -> None:
    """Tests use this to exercise the gloo-equivalent paths on a backend that has the
    native collectives."""
    for k in ([which] if which else list(_native_ok)):
        _native_ok[k] = not enabled
