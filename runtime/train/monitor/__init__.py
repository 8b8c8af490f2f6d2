"""Training metrics: one sink interface (sink.py), the sinks (progress line, TensorBoard,
CSV, wandb, comet) and `build_monitor`, which turns the config's monitor sections into
the Monitor the engine writes to (`engine.monitor`)."""
from __future__ import annotations

import sys
from typing import Callable, List

from .meter import StepMeter
from .sink import LOSS_SCALE, LR, TIMER_EVENT, TRAIN_LOSS, Event, MetricsSink, Monitor, StepRecord

__all__ = ["Monitor", "MetricsSink", "StepRecord", "StepMeter", "Event", "build_monitor", "TRAIN_LOSS", "LR",
           "LOSS_SCALE", "TIMER_EVENT"]

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _open(section: str, make: Callable[[], MetricsSink], sinks: List[MetricsSink]) -> None:
    try:
        sinks.append(make())
    except ImportError as exc:
        package = _PACKAGES.get(section, section)
        extra = " (pip install 'dslaunch[monitor]')" if section == "tensorboard" else ""
        print(f"warning: {section}.enabled: the {package} package is not installed{extra}; no events go to "
              f"{section} ({exc})", file=sys.stderr, flush=True)


def build_monitor(config, rank: int, progress: MetricsSink = None) -> Monitor:
    """Rank 0 gets the progress sink plus every enabled monitor; other ranks get none."""
    sinks: List[MetricsSink] = []
    if rank != 0:
        return Monitor(sinks)
    if progress is not None:
        sinks.append(progress)
    tb, csv_cfg, wb, comet = config.tensorboard, config.csv_monitor, config.wandb, config.comet
    if tb.enabled:
        from .files import TensorBoardSink

        _open("tensorboard", lambda: TensorBoardSink(tb.output_path, tb.job_name), sinks)
    if csv_cfg.enabled:
        from .files import CSVSink

        _open("csv_monitor", lambda: CSVSink(csv_cfg.output_path, csv_cfg.job_name), sinks)
    if wb.enabled:
        from .services import WandbSink

        _open("wandb", lambda: WandbSink(wb.project, wb.group, wb.team), sinks)
    if comet.enabled:
        from .services import CometSink

        _open("comet", lambda: CometSink(comet), sinks)
    return Monitor(sinks)
