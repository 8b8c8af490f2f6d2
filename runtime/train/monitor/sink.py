"""One metrics interface for everything a training run reports.

At every optimizer step the engine builds one `StepRecord` (DeepSpeed's event names ->
values, plus the step and sample counters) and hands it to the `Monitor`, which passes it
to every sink: the progress line, TensorBoard, CSV files, wandb, comet. User code adds
its own events with `engine.monitor.write_events([(name, value, x), ...])`, DeepSpeed's
call. Only rank 0 writes; on other ranks the Monitor has no sinks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

Event = Tuple[str, float, int]  # (name, value, x); DeepSpeed's x is the global sample count

TRAIN_LOSS = "Train/Samples/train_loss"
LR = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
TIMER_EVENT = "Train/Samples/elapsed_time_ms_{}"  # forward, backward, backward_inner, backward_allreduce, step


@dataclass
class StepRecord:
    step: int  # optimizer steps done (DeepSpeed's global_steps)
    samples: int  # samples consumed across all ranks (DeepSpeed's global_samples; the events' x)
    values: Dict[str, float] = field(default_factory=dict)  # event name -> this step's value
    skipped: int = 0  # optimizer steps skipped so far (fp16 overflow, bf16 inf/nan)
    total_steps: Optional[int] = None  # when known: engine.set_train_steps(n) or the data loader's length
    epoch_steps: Optional[int] = None  # optimizer steps per epoch of initialize()'s data loader
    alert: Optional[str] = None  # something the progress line must say now (a non-finite step)

    def events(self) -> List[Event]:
        return [(name, float(value), self.samples) for name, value in self.values.items()]


class MetricsSink:
    """A destination for step records and user events. Sinks never raise on a write:
    a failing destination says so once on stderr and is dropped by the Monitor."""

    name = "sink"

    def write_step(self, record: StepRecord) -> None:
        self.write_events(record.events())

    def write_events(self, events: Sequence[Event]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Monitor:
    """Fans records and events out to its sinks (DeepSpeed's MonitorMaster)."""

    def __init__(self, sinks: Iterable[MetricsSink] = ()):
        self.sinks: List[MetricsSink] = list(sinks)

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def add(self, sink: MetricsSink) -> None:
        self.sinks.append(sink)

    def write_step(self, record: StepRecord) -> None:
        self._each("write_step", record)

    def write_events(self, events: Sequence[Event]) -> None:
        """DeepSpeed's engine.monitor.write_events([(name, value, x), ...])."""
        events = [(str(n), float(v), int(x)) for n, v, x in events]
        self._each("write_events", events)

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")
        self.sinks = []

    def _each(self, method: str, *args) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # a monitor must never stop training
                print(f"warning: {sink.name}: {method} failed ({type(exc).__name__}: {exc}); no more events go "
                      f"there", file=sys.stderr, flush=True)
                self.sinks.remove(sink)
