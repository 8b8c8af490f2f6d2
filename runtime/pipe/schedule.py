"""Pipeline schedules as pure instruction streams (no torch, no processes).

A schedule is iterated once per batch; each item is the list of instructions one stage
runs in one step. Steps are lock-step across stages: any step boundary can be a barrier
without deadlock, because every send in a step is matched by the neighbour's receive in
the same step, in the same order.

TrainSchedule (1F1B, DeepSpeed's TrainSchedule): 2 * (m + p - 1) steps for m micro-batches
on p stages. Stage s runs the forward of micro-batch b at step 2b + s and its backward at
step 2b + 2p - 1 - s; in between it alternates one forward and one backward, so at most
p - s activations are alive at once. Results move one step later: the activation of the
forward at step t is sent at step t + 1 (when the next stage, one step behind, receives it),
the same for gradients going back. Each stage computes in 2m of the 2(m + p - 1) steps:
the bubble is (p - 1) / (m + p - 1) of the batch.

InferenceSchedule: m + p - 1 forward-only steps through two alternating buffers (even
stages send before receiving, odd stages receive first).

The instruction names and fields are DeepSpeed's (`repr` gives e.g. "ForwardPass(buffer_id=1)"),
so streams compare one to one with DeepSpeed's (tests/fixtures/deepspeed_pipe.json).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class PipeInstruction:
    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


@dataclass(frozen=True, repr=False)
class OptimizerStep(PipeInstruction):
    """Clip, step the optimizer and the LR scheduler, zero the gradients."""


@dataclass(frozen=True, repr=False)
class ReduceGrads(PipeInstruction):
    """Reduce gradients over the data-parallel group of this stage."""


@dataclass(frozen=True, repr=False)
class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of weights tied across stages (e.g. embedding and LM head)."""


@dataclass(frozen=True, repr=False)
class BufferOpInstruction(PipeInstruction):
    """Work on one micro-batch's buffer; `chunk` is the model chunk (virtual stage) of this
    rank it concerns, 0 unless the schedule interleaves chunks (then repr shows it)."""

    buffer_id: int
    chunk: int = 0

    @property
    def kwargs(self) -> dict:
        out = {"buffer_id": self.buffer_id}
        if self.chunk:
            out["chunk"] = self.chunk
        return out


@dataclass(frozen=True, repr=False)
class LoadMicroBatch(BufferOpInstruction):
    """First stage: inputs; last stage: labels."""


@dataclass(frozen=True, repr=False)
class ForwardPass(BufferOpInstruction):
    pass


@dataclass(frozen=True, repr=False)
class BackwardPass(BufferOpInstruction):
    pass


@dataclass(frozen=True, repr=False)
class BackwardInput(BufferOpInstruction):
    """The input-gradient half of a backward pass: the gradient of every layer's input on the
    stage (the one of the stage's input goes upstream); the weights' gradients wait for the
    matching BackwardWeight, the graph is kept for it."""


@dataclass(frozen=True, repr=False)
class BackwardWeight(BufferOpInstruction):
    """The weight-gradient half: each layer's weight gradients from the output gradients its
    BackwardInput kept; accumulated into .grad as a whole backward pass would."""


@dataclass(frozen=True, repr=False)
class SendActivation(BufferOpInstruction):
    pass


@dataclass(frozen=True, repr=False)
class RecvActivation(BufferOpInstruction):
    pass


@dataclass(frozen=True, repr=False)
class SendGrad(BufferOpInstruction):
    pass


@dataclass(frozen=True, repr=False)
class RecvGrad(BufferOpInstruction):
    pass


@dataclass(frozen=True)
class Link:
    """Where one model chunk of a stage receives from and sends to: the neighbouring
    pipeline stages (None at either end of the pipeline) and the message tags of each flow,
    so that flows between the same two ranks (interleaved chunks send both ways) never mix."""

    prev_stage: Optional[int]
    next_stage: Optional[int]
    recv_act_tag: int = 0
    send_act_tag: int = 0
    recv_grad_tag: int = 0
    send_grad_tag: int = 0


class PipeSchedule:
    """Base: `micro_batches` micro-batches through `stages` stages, as seen by `stage_id`.

    `chunks`: model chunks per stage (virtual stages; chunk c of stage s is virtual stage
    c * stages + s). `async_sends`: the executor must not block on a send (the stream's
    order is deadlock-free only when sends return at once and receives wait); a lock-step
    stream such as TrainSchedule's pairs each send with the neighbour's receive instead."""

    chunks = 1
    async_sends = False
    split_backward = False  # True: BackwardInput / BackwardWeight instead of BackwardPass

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        if micro_batches < 1 or stages < 1 or not 0 <= stage_id < stages:
            raise ValueError(f"schedule: need micro_batches >= 1, stages >= 1 and 0 <= stage_id < stages "
                             f"(got {micro_batches}, {stages}, {stage_id})")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    # DeepSpeed's PipeSchedule reads the same three through these names too
    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def num_pipe_buffers(self) -> int:
        return self.micro_batches

    def _valid_micro_batch(self, b: int) -> bool:
        return 0 <= b < self.micro_batches

    def _valid_stage(self, s: int) -> bool:
        return 0 <= s < self.stages

    def _buffer_idx(self, b: int) -> int:
        return b % self.num_pipe_buffers()

    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.stages + self.stage_id

    def link(self, chunk: int = 0) -> Link:
        vs, last = self.virtual_stage(chunk), self.stages * self.chunks - 1
        prev = (vs - 1) % self.stages if vs > 0 else None
        nxt = (vs + 1) % self.stages if vs < last else None
        if self.chunks == 1:
            return Link(prev, nxt)
        # activation into virtual stage t: tag 2t; gradient into t: 2t + 1
        return Link(prev, nxt, 2 * vs, 2 * (vs + 1), 2 * vs + 1, 2 * (vs - 1) + 1)

    def steps(self) -> Iterator[List[PipeInstruction]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[List[PipeInstruction]]:
        return self.steps()


class TrainSchedule(PipeSchedule):
    def activations_in_flight(self) -> int:
        """Micro-batches whose activations stage s holds at once: p - s (fewer if the batch
        is smaller)."""
        return min(self.stages - self.stage_id, self.micro_batches)

    def num_pipe_buffers(self) -> int:
        return max(2, self.activations_in_flight())

    def step_work(self, step: int):
        """(micro-batch, is_forward) this stage computes at `step`; the micro-batch may be
        out of range (an idle step: part of the bubble)."""
        s, p = self.stage_id, self.stages
        if (step - s) % 2 == 0:
            return (step - s) // 2, True
        return (step - (2 * p - 1 - s)) // 2, False

    def total_steps(self) -> int:
        return 2 * (self.micro_batches + self.stages - 1)

    def steps(self):
        total = self.total_steps()
        prev_b = -1
        for step in range(total):
            b, forward = self.step_work(step)
            cmds: List[PipeInstruction] = []
            prev_ok, cur_ok = self._valid_micro_batch(prev_b), self._valid_micro_batch(b)
            # the previous step's result goes out; this step's input comes in
            if forward:
                if prev_ok and self._valid_stage(self.prev_stage):
                    cmds.append(SendGrad(self._buffer_idx(prev_b)))
                if cur_ok and self._valid_stage(self.prev_stage):
                    cmds.append(RecvActivation(self._buffer_idx(b)))
            else:
                if cur_ok and self._valid_stage(self.next_stage):
                    cmds.append(RecvGrad(self._buffer_idx(b)))
                if prev_ok and self._valid_stage(self.next_stage):
                    cmds.append(SendActivation(self._buffer_idx(prev_b)))
            if (self.is_first_stage or self.is_last_stage) and forward and cur_ok:
                cmds.append(LoadMicroBatch(self._buffer_idx(b)))
            if cur_ok:
                cmds.append(ForwardPass(self._buffer_idx(b)) if forward else BackwardPass(self._buffer_idx(b)))
            if step == total - 1:
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            prev_b = b
            yield cmds


class InferenceSchedule(PipeSchedule):
    def num_pipe_buffers(self) -> int:
        return 2

    def total_steps(self) -> int:
        return self.micro_batches + self.stages - 1

    def steps(self):
        even = self.stage_id % 2 == 0
        for step in range(self.total_steps()):
            b = step - self.stage_id
            recv_buf, send_buf = (step % 2, (step + 1) % 2) if even else ((step + 1) % 2, step % 2)
            cmds: List[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(b):
                cmds.append(LoadMicroBatch(recv_buf))
            send = ([SendActivation(send_buf)]
                    if self._valid_stage(self.next_stage) and self._valid_micro_batch(b - 1) else [])
            recv = ([RecvActivation(recv_buf)]
                    if self._valid_stage(self.prev_stage) and self._valid_micro_batch(b) else [])
            cmds += send + recv if even else recv + send
            if self._valid_micro_batch(b):
                cmds.append(ForwardPass(recv_buf))
            yield cmds


@dataclass(frozen=True)
class Work:
    """One compute pass in a stage's order: F(orward), B(ackward, whole), I(nput-gradient
    half) or W(eight-gradient half) of micro-batch `mb` in model chunk `chunk`."""

    kind: str
    mb: int
    chunk: int = 0


class OrderedSchedule(PipeSchedule):
    """A training schedule given by the order in which each stage computes (order());
    the instruction stream follows from it: a forward receives its input first and sends
    its output after, a backward (or its input half) receives the output gradient first and
    sends the input gradient after, at the ends of the pipeline neither. Every step is one
    compute pass with its transfers. Sends do not block (async_sends); the order must only
    respect the data flow, which simulate() checks."""

    async_sends = True

    def order(self) -> List[Work]:
        raise NotImplementedError

    def num_pipe_buffers(self) -> int:
        return self.micro_batches  # buffer b holds micro-batch b (per chunk)

    def _loads(self, w: Work) -> bool:
        """Inputs are read at the first virtual stage's forward, labels at the last's; a
        stage that is both reads once."""
        if w.chunk == 0 and self.is_first_stage:
            return True
        return w.chunk == self.chunks - 1 and self.is_last_stage and not self.is_first_stage

    def _train(self) -> bool:
        return True

    def activations_in_flight(self) -> int:
        """The most micro-batches whose activations this stage holds at once (a chunk's
        count as 1/chunks): from a forward until its backward (until its W when split)."""
        alive = peak = 0
        for w in self.order():
            alive += {"F": 1, "B": -1, "W": -1}.get(w.kind, 0)
            peak = max(peak, alive)
        return -(-peak // self.chunks)

    def steps(self):
        works = self.order()
        last_vs = self.stages * self.chunks - 1
        for i, w in enumerate(works):
            vs, b, c = self.virtual_stage(w.chunk), w.mb, w.chunk
            cmds: List[PipeInstruction] = []
            if w.kind == "F":
                if vs > 0:
                    cmds.append(RecvActivation(b, c))
                if self._loads(w):
                    cmds.append(LoadMicroBatch(b, c))
                cmds.append(ForwardPass(b, c))
                if vs < last_vs:
                    cmds.append(SendActivation(b, c))
            elif w.kind in ("B", "I"):
                if vs < last_vs:
                    cmds.append(RecvGrad(b, c))
                cmds.append(BackwardPass(b, c) if w.kind == "B" else BackwardInput(b, c))
                if vs > 0:
                    cmds.append(SendGrad(b, c))
            elif w.kind == "W":
                cmds.append(BackwardWeight(b, c))
            else:
                raise ValueError(f"schedule: unknown pass {w.kind!r}")
            if i == len(works) - 1 and self._train():
                cmds += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            yield cmds


class ZeroBubbleH1Schedule(OrderedSchedule):
    """ZB-H1: 1F1B with each backward split into its input-gradient half (I), which the
    stage upstream waits for, and its weight-gradient half (W), which nobody waits for.
    Stage s runs 1F1B's warm-up (p - 1 - s forwards), then a forward and an I in turn,
    keeping the W of up to s micro-batches back (the later the stage, the sooner its I
    must go upstream); in the cool-down, where 1F1B waits for each gradient from
    downstream, it runs one held-back W after each I, and the rest at the end. A stage
    holds at most p micro-batches' activations (forwards not yet backwarded plus W's held
    back), the first stage's count under 1F1B, so the peak over stages does not grow.
    With F, I and W of equal time the idle share per stage is (p - 1) / (3m + p - 1)
    against 1F1B's (p - 1) / (m + p - 1) (simulate() shows it; scripts/bench_pipeline.py
    measures it)."""

    split_backward = True

    def order(self) -> List[Work]:
        m, p, s = self.micro_batches, self.stages, self.stage_id
        warm = min(p - 1 - s, m)
        out = [Work("F", b) for b in range(warm)]
        held: List[int] = []
        for k in range(m - warm):
            out += [Work("F", warm + k), Work("I", k)]
            held.append(k)
            if len(held) > s:
                out.append(Work("W", held.pop(0)))
        for k in range(m - warm, m):
            out.append(Work("I", k))
            held.append(k)
            out.append(Work("W", held.pop(0)))
        return out + [Work("W", b) for b in held]


class Interleaved1F1BSchedule(OrderedSchedule):
    """Interleaved 1F1B: each stage holds `chunks` model chunks (virtual stages s, s + p,
    ...). Micro-batches go through a stage's chunks in groups of p: forwards visit chunk 0
    for micro-batches 0..p-1, then chunk 1 for the same ones, ..., then chunk 0 for p..2p-1;
    backwards the same with the chunks in reverse. Stage s warms up with 2(p - 1 - s) +
    (chunks - 1)p forwards, then alternates one forward and one backward, then drains. The
    bubble shrinks by the number of chunks: (p - 1) / (chunks * m + p - 1) of the batch,
    for p - 1 more transfers per micro-batch. Needs micro_batches a multiple of stages."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, chunks: int = 2):
        super().__init__(micro_batches, stages, stage_id)
        if chunks < 1:
            raise ValueError(f"schedule: interleaved 1F1B needs chunks >= 1, got {chunks}")
        if micro_batches % stages:
            raise ValueError(f"schedule: interleaved 1F1B needs the micro-batches ({micro_batches}) to be a "
                             f"multiple of the pipeline stages ({stages})")
        self.chunks = chunks

    def _work(self, k: int, forward: bool) -> Work:
        p, v = self.stages, self.chunks
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return Work("F", mb, chunk) if forward else Work("B", mb, v - 1 - chunk)

    def _warmup(self, total: int) -> int:
        return min(2 * (self.stages - 1 - self.stage_id) + (self.chunks - 1) * self.stages, total)

    def order(self) -> List[Work]:
        total = self.micro_batches * self.chunks
        warm = self._warmup(total)
        out = [self._work(k, True) for k in range(warm)]
        for k in range(total - warm):
            out += [self._work(warm + k, True), self._work(k, False)]
        return out + [self._work(k, False) for k in range(total - warm, total)]


class ChunkedInferenceSchedule(Interleaved1F1BSchedule):
    """Forward only through chunked stages (eval_batch of an interleaved pipeline): the
    interleaved forward order, nothing else."""

    def _train(self) -> bool:
        return False

    def order(self) -> List[Work]:
        return [self._work(k, True) for k in range(self.micro_batches * self.chunks)]


# -- by name ------------------------------------------------------------------------------------
SCHEDULES: Dict[str, Callable[..., PipeSchedule]] = {
    "1f1b": lambda m, p, s, chunks=1: TrainSchedule(m, p, s),
    "zb-h1": lambda m, p, s, chunks=1: ZeroBubbleH1Schedule(m, p, s),
    "interleaved-1f1b": lambda m, p, s, chunks=2: Interleaved1F1BSchedule(m, p, s, chunks),
}
CHUNKED = frozenset({"interleaved-1f1b"})  # schedules that run several model chunks per stage
SPLIT = frozenset({"zb-h1"})  # schedules that split backward (a layer's graph must outlive its I pass)


def unknown_schedule(name) -> Optional[str]:
    """Why `name` is no schedule (None if it is one)."""
    if name in SCHEDULES:
        return None
    return f"unknown schedule {name!r}; valid: {', '.join(sorted(SCHEDULES))}"


def train_schedule(name: str, micro_batches: int, stages: int, stage_id: int, chunks: int = 1) -> PipeSchedule:
    problem = unknown_schedule(name)
    if problem:
        raise ValueError(problem)
    if name in CHUNKED:
        return SCHEDULES[name](micro_batches, stages, stage_id, chunks)
    return SCHEDULES[name](micro_batches, stages, stage_id)


# -- a clock for schedules (pure) ----------------------------------------------------------------
COSTS = {ForwardPass: 1.0, BackwardPass: 2.0, BackwardInput: 1.0, BackwardWeight: 1.0}


@dataclass
class Simulation:
    """Each stage's compute intervals (start, end, instruction) on one clock, and every
    flow's messages in the order sent and received: {(src, dst, tag, kind): [(buffer, chunk)]}."""

    busy: List[List[Tuple[float, float, PipeInstruction]]]
    sent: Dict[tuple, list]
    received: Dict[tuple, list]

    @property
    def makespan(self) -> float:
        return max((iv[-1][1] for iv in self.busy if iv), default=0.0)

    def idle_share(self, stage: int) -> float:
        span = self.makespan
        return 1.0 - sum(e - b for b, e, _ in self.busy[stage]) / span if span else 0.0

    def bubble(self) -> float:
        """Mean idle share over the stages."""
        return sum(self.idle_share(s) for s in range(len(self.busy))) / len(self.busy)


def simulate(schedules: Sequence[PipeSchedule], costs: Optional[Dict[type, float]] = None) -> Simulation:
    """Run one schedule per stage together: a compute pass takes costs[type] time, a send
    posts its message at once, a receive waits for the message of its flow. Raises
    ValueError on a deadlock (a stage waits for a message never sent) or a message never
    received."""
    costs = COSTS if costs is None else costs
    p = len(schedules)
    streams = [[c for step in sch for c in step] for sch in schedules]
    links = [{c: sch.link(c) for c in range(sch.chunks)} for sch in schedules]
    pos, clock = [0] * p, [0.0] * p
    busy: List[List[Tuple[float, float, PipeInstruction]]] = [[] for _ in range(p)]
    queues: Dict[tuple, list] = {}
    sent: Dict[tuple, list] = {}
    received: Dict[tuple, list] = {}

    def flow(s, cmd):
        ln = links[s][getattr(cmd, "chunk", 0)]
        if isinstance(cmd, SendActivation):
            return (s, ln.next_stage, ln.send_act_tag, "act")
        if isinstance(cmd, RecvActivation):
            return (ln.prev_stage, s, ln.recv_act_tag, "act")
        if isinstance(cmd, SendGrad):
            return (s, ln.prev_stage, ln.send_grad_tag, "grad")
        return (ln.next_stage, s, ln.recv_grad_tag, "grad")

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pos[s] < len(streams[s]):
                cmd = streams[s][pos[s]]
                if isinstance(cmd, (RecvActivation, RecvGrad)):
                    key = flow(s, cmd)
                    if not queues.get(key):
                        break
                    t, what = queues[key].pop(0)
                    received.setdefault(key, []).append(what)
                    clock[s] = max(clock[s], t)
                elif isinstance(cmd, (SendActivation, SendGrad)):
                    key = flow(s, cmd)
                    queues.setdefault(key, []).append((clock[s], (cmd.buffer_id, cmd.chunk)))
                    sent.setdefault(key, []).append((cmd.buffer_id, cmd.chunk))
                elif type(cmd) in costs:  # a chunk holds 1/chunks of the stage's layers
                    cost = costs[type(cmd)] / schedules[s].chunks
                    busy[s].append((clock[s], clock[s] + cost, cmd))
                    clock[s] += cost
                pos[s] += 1
                progress = True
    stuck = [s for s in range(p) if pos[s] < len(streams[s])]
    if stuck:
        raise ValueError(f"schedule: deadlock: stage {stuck[0]} waits at {streams[stuck[0]][pos[stuck[0]]]!r}")
    left = {k: q for k, q in queues.items() if q}
    if left:
        raise ValueError(f"schedule: messages never received on flow {next(iter(left))}")
    return Simulation(busy, sent, received)


def bubble_fraction(micro_batches: int, stages: int) -> float:
    """The idle share of a 1F1B batch: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
