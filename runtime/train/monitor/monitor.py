"""DeepSpeed's monitor classes (`deepspeed.monitor.monitor`, `.tensorboard`, `.csv_monitor`,
`.wandb`, `.comet`), for scripts that build their own monitor from a config section.

Each is built from its section of the config (`DeepSpeedConfig.monitor_config.<section>`)
and writes `(name, value, step)` events through this package's sinks, on rank 0 only, as
DeepSpeed's do; a disabled section writes nothing. The engine's own monitor is built by
build_monitor (same sinks), so events look the same from either.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from ...core import comm
from .sink import Event, MetricsSink


def _rank() -> int:
    return comm.get_rank() if comm.is_initialized() else 0


class Monitor(ABC):
    """DeepSpeed's base: built from a config section, writes lists of events."""

    @abstractmethod
    def __init__(self, monitor_config):
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        ...


class _SinkMonitor(Monitor):
    def __init__(self, config):
        super().__init__(config)
        self.enabled = config.enabled
        self.sink: Optional[MetricsSink] = self._open(config) if self.enabled and _rank() == 0 else None

    def _open(self, config) -> MetricsSink:
        raise NotImplementedError

    def write_events(self, event_list: Sequence[Event]) -> None:
        if self.sink is not None:
            self.sink.write_events(list(event_list))

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()


class TensorBoardMonitor(_SinkMonitor):
    """Event files under `<output_path>/<job_name>/` (needs the tensorboard package)."""

    def __init__(self, tensorboard_config):
        self.output_path, self.job_name = tensorboard_config.output_path, tensorboard_config.job_name
        super().__init__(tensorboard_config)

    def _open(self, config) -> MetricsSink:
        from .files import TensorBoardSink

        return TensorBoardSink(config.output_path, config.job_name)


class csvMonitor(_SinkMonitor):  # noqa: N801  DeepSpeed's name
    """One CSV file per event under `<output_path>/<job_name>/`."""

    def __init__(self, csv_config):
        self.output_path, self.job_name = csv_config.output_path, csv_config.job_name
        super().__init__(csv_config)

    def _open(self, config) -> MetricsSink:
        from .files import CSVSink

        return CSVSink(config.output_path, config.job_name)


class WandbMonitor(_SinkMonitor):
    """wandb.log of every event (needs the wandb package)."""

    def __init__(self, wandb_config):
        self.group, self.team, self.project = wandb_config.group, wandb_config.team, wandb_config.project
        super().__init__(wandb_config)

    def _open(self, config) -> MetricsSink:
        from .services import WandbSink

        return WandbSink(config.project, config.group, config.team)


class CometMonitor(_SinkMonitor):
    """comet_ml experiment metrics, each event at most once per samples_log_interval samples
    (needs the comet_ml package)."""

    def __init__(self, comet_config):
        self._samples_log_interval = comet_config.samples_log_interval
        super().__init__(comet_config)

    def _open(self, config) -> MetricsSink:
        from .services import CometSink

        return CometSink(config)

    @property
    def experiment(self):
        return self.sink.experiment if self.sink is not None else None

    @property
    def samples_log_interval(self) -> int:
        return self._samples_log_interval


class MonitorMaster(Monitor):
    """Every enabled monitor of a DeepSpeedMonitorConfig (`DeepSpeedConfig.monitor_config`)."""

    def __init__(self, monitor_config):
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.tb_monitor = self.wandb_monitor = self.csv_monitor = self.comet_monitor = None
        if _rank() == 0:
            if monitor_config.tensorboard.enabled:
                self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
            if monitor_config.wandb.enabled:
                self.wandb_monitor = WandbMonitor(monitor_config.wandb)
            if monitor_config.csv_monitor.enabled:
                self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
            if monitor_config.comet.enabled:
                self.comet_monitor = CometMonitor(monitor_config.comet)

    def write_events(self, event_list: Sequence[Event]) -> None:
        for m in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor):
            if m is not None:
                m.write_events(event_list)
