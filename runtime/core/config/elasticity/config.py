"""The `elasticity` section, its errors (DeepSpeed's names), and reading it from a dict."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ...strict import ConfigError, parse_dataclass, supported
from ..checks import positive


class ElasticityError(ConfigError):
    """Base of every elasticity error (one line, exit 2 when uncaught)."""


class ElasticityConfigError(ElasticityError):
    pass


class ElasticityIncompatibleWorldSize(ElasticityError):
    pass


@dataclass
class ElasticityConfig:
    enabled: bool = supported(False, "the batch sizes come from compute_elastic_config for the world size")
    max_train_batch_size: Optional[int] = supported(None, "the largest acceptable global batch")
    micro_batch_sizes: Optional[List[int]] = supported(None, "the acceptable micro batches per GPU")
    min_gpus: int = supported(1, "smallest world size searched")
    max_gpus: int = supported(10000, "largest world size searched")
    min_time: int = supported(0, "minutes before a scheduler may rescale (recorded for the scheduler)")
    version: float = supported(0.2, "0.1: GPUs; 0.2: nodes of num_gpus_per_node, with model parallelism")
    ignore_non_elastic_batch_info: bool = supported(
        False, "false: batch keys outside this section are an error; true: they are overridden")
    prefer_larger_batch: bool = supported(True, "ties go to the larger batch")
    num_gpus_per_node: int = supported(1, "GPUs per node (version 0.2)")
    model_parallel_size: int = supported(1, "model-parallel degree (version 0.2)")

    def validate(self, path: str) -> None:
        for key in ("min_gpus", "max_gpus", "num_gpus_per_node", "model_parallel_size", "max_train_batch_size"):
            positive(path, key, getattr(self, key))
        positive(path, "min_time", self.min_time, allow_zero=True)
        if self.max_gpus < self.min_gpus:
            raise ConfigError(f"{path}.min_gpus: {self.min_gpus} is greater than max_gpus {self.max_gpus}")
        if self.enabled:
            for key in ("max_train_batch_size", "micro_batch_sizes"):
                if getattr(self, key) is None:
                    raise ConfigError(f"{path}.{key}: required when elasticity is enabled")
            if not self.micro_batch_sizes or any(m <= 0 for m in self.micro_batch_sizes):
                raise ConfigError(f"{path}.micro_batch_sizes: must be a non-empty list of positive integers, "
                                  f"got {self.micro_batch_sizes}")
            if self.version not in (0.1, 0.2):
                raise ConfigError(f"{path}.version: must be 0.1 or 0.2, got {self.version}")


def read_section(ds_config):
    """The parsed `elasticity` section of a DeepSpeed config dict (must be enabled)."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"compute_elastic_config: expected the DeepSpeed config as a dict, got "
                         f"{type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("elasticity: missing from the config; add it to run an elastic job")
    raw = ds_config["elasticity"]
    if not isinstance(raw, dict):
        raise ElasticityConfigError(f"elasticity: expected an object, got {raw!r}")
    if not raw.get("enabled", False):
        raise ElasticityConfigError("elasticity.enabled: elasticity is disabled; set \"enabled\": true to run an "
                                    "elastic job")
    try:
        return parse_dataclass(ElasticityConfig, raw, "elasticity")
    except ConfigError as exc:
        raise ElasticityConfigError(str(exc)) from None
