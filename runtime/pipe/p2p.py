"""Activations and gradients between neighbouring stages: send/recv through runtime.comm
(torch.distributed point-to-point, which gloo and NCCL both provide) on the world group.
Between two stages on one host, CPU tensors go through shared-memory rings instead
(comm/shm_p2p.py): share_memory() sets them up for a pipeline's flows when the engine is
built, and comm's send/recv route each flow that got one; cross-host neighbours (and CUDA
tensors) stay on gloo (NCCL).

What travels is a tensor or a tuple of tensors. Before the first transfer of a batch the
sender describes it (kind, and each tensor's dtype and shape) in one fixed-size int64
header; the receiver allocates from that and reuses the description for the rest of the
batch, so shapes may change from one batch to the next at the cost of one small message
per stage boundary and batch. Inside a batch every micro-batch must have the shapes of
the first unless the module was built with dynamic_shape=True (then every transfer
carries its header). Gradients need no header: the receiver knows the shapes of the
activations it sent.

bool tensors travel as uint8 (NCCL has no bool type).

A schedule whose order is deadlock-free only when sends do not block (schedule.py's
OrderedSchedule) gets a link with async_sends: each send is posted (isend) and kept with
its tensor until wait_sends() at the end of the batch. Each link carries the message tags
of its flows (schedule.Link), so the flows of several model chunks between the same two
ranks stay apart.

When the first stage cannot read its batch, the header it sends instead says so
(KIND_ABORT); each stage passes it on and raises the same error, so no stage is left
waiting for an activation that will never come.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..core import comm
from .module import PipelineError
from .schedule import Link

HEADER = 256  # int64 slots: [kind, count, then per tensor: dtype, ndim, *shape]
KIND_TENSOR, KIND_TUPLE = 0, 2  # DeepSpeed's codes
KIND_ABORT = 99  # [99, reason, micro-batches read, micro-batches wanted]: the batch is called off
DTYPES = [torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16, torch.bfloat16, torch.uint8,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.bool]

Payload = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Meta:
    """What one transfer holds: a lone tensor or a tuple, and each tensor's (dtype, shape)."""

    is_tuple: bool
    specs: Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]

    @staticmethod
    def of(payload: Payload) -> "Meta":
        tensors = payload if isinstance(payload, tuple) else (payload,)
        for t in tensors:
            if not torch.is_tensor(t):
                raise PipelineError(f"pipeline: a stage's output must be a tensor or a tuple of tensors, "
                                    f"got {type(t).__name__}")
        return Meta(isinstance(payload, tuple), tuple((t.dtype, tuple(t.shape)) for t in tensors))

    def encode(self, device) -> torch.Tensor:
        row = [KIND_TUPLE if self.is_tuple else KIND_TENSOR, len(self.specs)]
        for dtype, shape in self.specs:
            row += [DTYPES.index(dtype), len(shape), *shape]
        if len(row) > HEADER:
            raise PipelineError(f"pipeline: {len(self.specs)} tensors with these shapes do not fit the "
                                f"{HEADER}-slot transfer header")
        out = torch.zeros(HEADER, dtype=torch.int64)
        out[:len(row)] = torch.tensor(row, dtype=torch.int64)
        return out.to(device)

    @staticmethod
    def decode(header: torch.Tensor) -> "Meta":
        row = header.tolist()
        kind, count, pos, specs = row[0], row[1], 2, []
        for _ in range(count):
            dtype, ndim = DTYPES[row[pos]], row[pos + 1]
            specs.append((dtype, tuple(row[pos + 2:pos + 2 + ndim])))
            pos += 2 + ndim
        return Meta(kind == KIND_TUPLE, tuple(specs))

    def describe(self) -> str:
        return ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, s in self.specs)


@dataclass(frozen=True)
class AbortNotice:
    """Why a batch is called off before it started: no data iterator, or one that ran out."""

    NO_DATA, RAN_OUT = 1, 2
    reason: int
    loaded: int
    wanted: int

    def encode(self, device) -> torch.Tensor:
        out = torch.zeros(HEADER, dtype=torch.int64)
        out[:4] = torch.tensor([KIND_ABORT, self.reason, self.loaded, self.wanted], dtype=torch.int64)
        return out.to(device)

    def message(self) -> str:
        if self.reason == self.NO_DATA:
            return ("pipeline: the first and last stages have no data: pass train_batch(data_iter=...), call "
                    "set_dataiterator(), or give initialize(training_data=...)")
        return (f"pipeline: the data iterator ran out after {self.loaded} of the {self.wanted} micro-batches of "
                f"this batch; give it at least {self.wanted} more (e.g. deepspeed.utils.RepeatingLoader(loader))")


class PipelineAborted(PipelineError):
    pass


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class StageLink:
    """This stage's sends and receives to the previous and next stage of its pipeline."""

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], device: torch.device,
                 dynamic_shape: bool = False, tags: Tuple[int, int, int, int] = (0, 0, 0, 0),
                 async_sends: bool = False):
        self.prev_rank, self.next_rank, self.device = prev_rank, next_rank, device
        # message tags: activations in, activations out, gradients in, gradients out
        self.recv_act_tag, self.send_act_tag, self.recv_grad_tag, self.send_grad_tag = tags
        self.async_sends = async_sends
        self._posted: List[Tuple[object, torch.Tensor]] = []  # (work, tensor) of sends not yet waited for
        self.group = comm.get_world_group()  # peers are named by global rank
        self.dynamic_shape = dynamic_shape
        self._sent: Optional[Meta] = None  # described to the next stage in this batch
        self._received: Optional[Meta] = None  # described by the previous stage in this batch

    def new_batch(self) -> None:
        """Forget the batch's shapes: the next activation transfer is described again."""
        self._sent = self._received = None

    def _send(self, tensor: torch.Tensor, peer: int, tag: int, label: str) -> None:
        if self.async_sends:
            self._posted.append((comm.isend(tensor, peer, group=self.group, tag=tag, label=label), tensor))
        else:
            comm.send(tensor, peer, group=self.group, tag=tag, label=label)

    def wait_sends(self) -> None:
        """Wait until every posted send has gone (its tensor may then be freed), and every
        send queued on a shared-memory ring is in it."""
        posted, self._posted = self._posted, []
        for work, _ in posted:
            work.wait()
        comm.wait_p2p_sends()

    # -- activations (forward) ------------------------------------------------------------
    def send_activation(self, payload: Payload) -> None:
        meta = Meta.of(payload)
        if self._sent is None or self.dynamic_shape:
            self._send(meta.encode(self.device), self.next_rank, self.send_act_tag, "activation shapes")
            self._sent = meta
        elif meta != self._sent:
            raise PipelineError(f"pipeline: this micro-batch's activations ({meta.describe()}) differ from the "
                                f"batch's first ({self._sent.describe()}); shapes may change between batches, "
                                "or build the PipelineModule with dynamic_shape=True")
        for t in (payload if isinstance(payload, tuple) else (payload,)):
            self._send(_wire(t.detach().contiguous()), self.next_rank, self.send_act_tag, "activation")

    def send_abort(self, notice: AbortNotice) -> None:
        comm.send(notice.encode(self.device), self.next_rank, group=self.group, tag=self.send_act_tag,
                  label="batch aborted")

    def _recv_header(self) -> torch.Tensor:
        header = torch.empty(HEADER, dtype=torch.int64, device=self.device)
        comm.recv(header, self.prev_rank, group=self.group, tag=self.recv_act_tag, label="activation shapes")
        header = header.cpu()
        if int(header[0]) == KIND_ABORT:
            notice = AbortNotice(*[int(v) for v in header[1:4]])
            if self.next_rank is not None:
                self.send_abort(notice)  # pass it on before stopping
            raise PipelineAborted(notice.message())
        return header

    def take_abort(self) -> None:
        """The last stage, which found the same data problem, takes the first stage's notice
        (so that no stage upstream stays blocked sending it)."""
        try:
            self._recv_header()
        except PipelineAborted:
            pass

    def recv_activation(self) -> Payload:
        if self._received is None or self.dynamic_shape:
            self._received = Meta.decode(self._recv_header())
        out = []
        for dtype, shape in self._received.specs:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            comm.recv(_wire(t), self.prev_rank, group=self.group, tag=self.recv_act_tag, label="activation")
            t.requires_grad_(t.is_floating_point())  # a leaf whose .grad goes back upstream
            out.append(t)
        return tuple(out) if self._received.is_tuple else out[0]

    # -- gradients (backward) ---------------------------------------------------------------
    def send_grads(self, inputs: Payload) -> None:
        """The gradient of every floating-point tensor this stage received (zeros where
        autograd produced none)."""
        for t in (inputs if isinstance(inputs, tuple) else (inputs,)):
            if t.is_floating_point():
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                self._send(g.contiguous(), self.prev_rank, self.send_grad_tag, "activation grad")

    def recv_grads(self, outputs: Payload) -> List[torch.Tensor]:
        grads = []
        for t in (outputs if isinstance(outputs, tuple) else (outputs,)):
            if t.is_floating_point():
                g = torch.empty_like(t, memory_format=torch.contiguous_format)
                comm.recv(g, self.next_rank, group=self.group, tag=self.recv_grad_tag, label="activation grad")
                grads.append(g)
        return grads


def share_memory(links: Sequence[Link], to_global, group) -> List[Tuple[int, int, int]]:
    """Collective over the pipeline's group (every stage of this replica): a shared-memory
    ring for each flow of these links (activations out and in, gradients out and in) whose two
    ranks are on this host. `to_global` maps a stage to its global rank. Returns the flows
    (sender, receiver, tag) that got one, the same on every stage."""
    sends, recvs = set(), set()
    for link in links:
        if link.next_stage is not None:
            nxt = to_global(link.next_stage)
            sends.add((nxt, link.send_act_tag))
            recvs.add((nxt, link.recv_grad_tag))
        if link.prev_stage is not None:
            prev = to_global(link.prev_stage)
            recvs.add((prev, link.recv_act_tag))
            sends.add((prev, link.send_grad_tag))
    return comm.connect_same_host_p2p(group, sends, recvs)


def floating(payload: Payload) -> Sequence[torch.Tensor]:
    return [t for t in (payload if isinstance(payload, tuple) else (payload,)) if t.is_floating_point()]
