"""What a run reports: monitors (`tensorboard`, `wandb`, `csv_monitor`, `comet`), the
`flops_profiler`, `timers`, and the logging keys' sections. Rank 0 writes all of them
(runtime/train/monitor/, runtime/train/profiling/)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..strict import ConfigError, supported
from .checks import positive


@dataclass
class TensorBoardConfig:
    enabled: bool = supported(False, "event files through torch.utils.tensorboard (the `tensorboard` extra)")
    output_path: str = supported("", "directory holding the job folder (empty: the working directory)")
    job_name: str = supported("DeepSpeedJobName", "folder inside output_path")


@dataclass
class CSVConfig:
    enabled: bool = supported(False, "one Train_Samples_<event>.csv (step,value rows) per event")
    output_path: str = supported("", "directory holding the job folder (empty: the working directory)")
    job_name: str = supported("DeepSpeedJobName", "folder inside output_path")


@dataclass
class WandbConfig:
    enabled: bool = supported(False, "wandb.log of every event (when wandb is installed; one line if not)")
    group: Optional[str] = supported(None, "wandb run group")
    team: Optional[str] = supported(None, "wandb entity")
    project: str = supported("deepspeed", "wandb project")


@dataclass
class CometConfig:
    enabled: bool = supported(False, "comet_ml experiment metrics (when comet_ml is installed; one line if not)")
    samples_log_interval: int = supported(100, "events are sent every this many samples")
    project: Optional[str] = supported(None, "comet project")
    workspace: Optional[str] = supported(None, "comet workspace")
    api_key: Optional[str] = supported(None, "comet API key")
    experiment_name: Optional[str] = supported(None, "comet experiment name")
    experiment_key: Optional[str] = supported(None, "key of the experiment to use")
    online: Optional[bool] = supported(None, "false: an offline experiment")
    mode: Optional[str] = supported(None, "comet_ml.start mode: get, create or get_or_create")

    def validate(self, path: str) -> None:
        positive(path, "samples_log_interval", self.samples_log_interval)


@dataclass
class FlopsProfilerConfig:
    enabled: bool = supported(False, "profile one training step (also turns on wall_clock_breakdown)")
    recompute_fwd_factor: float = supported(0.0, "extra forward passes counted per step (activation recompute)")
    profile_step: int = supported(1, "the global step that is profiled")
    module_depth: int = supported(-1, "deepest module level in the per-module table (-1: all)")
    top_modules: int = supported(1, "modules listed per depth in the aggregated table")
    detailed: bool = supported(True, "print the per-module tree")
    output_file: Optional[str] = supported(None, "write the profile here instead of stdout")

    def validate(self, path: str) -> None:
        positive(path, "profile_step", self.profile_step)
        positive(path, "top_modules", self.top_modules)
        positive(path, "recompute_fwd_factor", self.recompute_fwd_factor, allow_zero=True)
        if self.module_depth < -1:
            raise ConfigError(f"{path}.module_depth: must be -1 (all) or >= 0, got {self.module_depth}")


@dataclass
class ThroughputTimerConfig:
    enabled: bool = supported(True, "samples/s in the progress line, and engine.tput_timer's counters")
    synchronized: bool = supported(True, "waits for the GPU before reading the clock (CUDA only)")


@dataclass
class TimersConfig:
    throughput: ThroughputTimerConfig = supported(factory=ThroughputTimerConfig,
                                                  note="the throughput timer of the progress line")
