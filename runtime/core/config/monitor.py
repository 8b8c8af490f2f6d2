"""`deepspeed.monitor.config`: the monitor sections of the config under DeepSpeed's names.

The sections are dslaunch's (runtime/core/config/observe.py); DeepSpeedMonitorConfig groups the
four, as `DeepSpeedConfig.monitor_config` returns them, with DeepSpeed's `enabled` (any on).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .observe import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig


@dataclass
class DeepSpeedMonitorConfig:
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CSVConfig = field(default_factory=CSVConfig)
    comet: CometConfig = field(default_factory=CometConfig)

    @property
    def enabled(self) -> bool:
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))


def get_monitor_config(config) -> DeepSpeedMonitorConfig:
    """The monitor sections of a parsed config, or of a config dict."""
    from . import DeepSpeedConfig

    return DeepSpeedConfig.load(config).monitor_config


__all__ = ["DeepSpeedMonitorConfig", "TensorBoardConfig", "WandbConfig", "CSVConfig", "CometConfig",
           "get_monitor_config"]
