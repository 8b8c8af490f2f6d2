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
from typing import Iterator, List


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
    buffer_id: int


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


class PipeSchedule:
    """Base: `micro_batches` micro-batches through `stages` stages, as seen by `stage_id`."""

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


def bubble_fraction(micro_batches: int, stages: int) -> float:
    """The idle share of a 1F1B batch: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro_batches + stages - 1)
