"""Sinks that send events to hosted services when their client package is installed:
Weights & Biases (`wandb`) and Comet (`comet_ml`)."""
from __future__ import annotations

from typing import Dict, Sequence

from .sink import Event, MetricsSink


class WandbSink(MetricsSink):
    name = "wandb"

    def __init__(self, project: str, group=None, team=None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, x in events:
            self.wandb.log({name: value}, step=x)

    def close(self) -> None:
        self.wandb.finish()


class CometSink(MetricsSink):
    """Each event name is sent when at least `samples_log_interval` samples passed since it
    was last sent (its first value is always sent)."""

    name = "comet"

    def __init__(self, cfg):
        import comet_ml

        self.experiment = comet_ml.start(api_key=cfg.api_key, project=cfg.project, workspace=cfg.workspace,
                                         experiment_key=cfg.experiment_key, mode=cfg.mode, online=cfg.online)
        if cfg.experiment_name is not None:
            self.experiment.set_name(cfg.experiment_name)
        self.interval = cfg.samples_log_interval
        self._last: Dict[str, int] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        for name, value, x in events:
            last = self._last.get(name)
            if last is None or x - last >= self.interval:
                self._last[name] = x
                self.experiment.log_metric(name, value, step=x)

    def close(self) -> None:
        self.experiment.end()
