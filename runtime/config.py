"""The DeepSpeed JSON config as typed dataclasses, and the batch-size rule.

Keys are spelt as DeepSpeed spells them so existing configs load unchanged; unknown keys
are refused (see strict.py). `DeepSpeedConfig.load(source)` accepts a dict, a JSON/YAML
path, or an already parsed config. Sections that belong to the ZeRO strategies
(`zero_optimization`, offload) are parsed here in full so that every stage shares one
schema; stage 0 accepts a stage 1-3 section at parse time and the engine refuses an
unregistered stage when it picks the strategy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional, Union

from .strict import ConfigError, load_file, parse_dataclass

OffloadDevice = Literal["none", "cpu", "nvme"]


def _positive(path: str, key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{path + '.' if path else ''}{key}: must be {bound}, got {value}")


@dataclass
class OptimizerConfig:
    type: str
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    type: str
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class FP16Config:
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0  # 0 means dynamic loss scaling
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def validate(self, path: str) -> None:
        _positive(path, "loss_scale", self.loss_scale, allow_zero=True)
        _positive(path, "loss_scale_window", self.loss_scale_window)
        _positive(path, "hysteresis", self.hysteresis)
        _positive(path, "min_loss_scale", self.min_loss_scale)


@dataclass
class BF16Config:
    enabled: bool = False


@dataclass
class AmpConfig:
    enabled: bool = False
    opt_level: str = "O1"

    def validate(self, path: str) -> None:
        if self.enabled:
            raise ConfigError(f"{path}.enabled: NVIDIA Apex amp is not supported; use \"fp16\" or \"bf16\" instead")


@dataclass
class _OffloadTarget:
    """Where offloaded tensors live; shared by offload_optimizer and offload_param."""

    device: OffloadDevice = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False

    def validate(self, path: str) -> None:
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(f"{path}.nvme_path: required when device is \"nvme\"")


@dataclass
class OffloadOptimizerConfig(_OffloadTarget):
    buffer_count: int = 4
    fast_init: bool = False
    ratio: float = 1.0


@dataclass
class OffloadParamConfig(_OffloadTarget):
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000


@dataclass
class ZeroConfig:
    """`zero_optimization`. Stage 0 is plain data parallelism (this package's engine);
    stages 1-3 are provided by strategies registered from dslaunch.runtime.zero."""

    stage: int = 0
    contiguous_gradients: bool = True
    overlap_comm: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    offload_optimizer: Optional[OffloadOptimizerConfig] = None
    offload_param: Optional[OffloadParamConfig] = None
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    sub_group_size: int = 1_000_000_000
    round_robin_gradients: bool = False
    load_from_fp32_weights: bool = True
    ignore_unused_parameters: bool = True
    elastic_checkpoint: bool = False

    # Older spellings DeepSpeed still reads; "all_reduce_bucket_size" is how the GPT-lite
    # post writes the gradient-reduction bucket.
    ALIASES = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        "all_reduce_bucket_size": "reduce_bucket_size",
        "allreduce_bucket_size": "reduce_bucket_size",
    }

    @classmethod
    def from_bool(cls, enabled: bool) -> "ZeroConfig":
        # The legacy `"zero_optimization": true` meant stage 1.
        return cls(stage=1 if enabled else 0)

    def validate(self, path: str) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}.stage: must be 0, 1, 2 or 3, got {self.stage}")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "sub_group_size"):
            _positive(path, key, getattr(self, key))
        _positive(path, "stage3_param_persistence_threshold", self.stage3_param_persistence_threshold, allow_zero=True)

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device if self.offload_param else "none"


@dataclass
class DeepSpeedConfig:
    train_batch_size: Optional[int] = None
    train_micro_batch_size_per_gpu: Optional[int] = None
    gradient_accumulation_steps: Optional[int] = None
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    amp: AmpConfig = field(default_factory=AmpConfig)
    gradient_clipping: float = 0.0
    zero_optimization: Union[bool, ZeroConfig] = field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: bool = False
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    dump_state: bool = False
    seed: Optional[int] = None

    ALIASES = {"bfloat16": "bf16"}

    def validate(self, path: str) -> None:
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            _positive(path, key, getattr(self, key))
        _positive(path, "gradient_clipping", self.gradient_clipping, allow_zero=True)
        _positive(path, "steps_per_print", self.steps_per_print)
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError("fp16.enabled and bf16.enabled: choose one of fp16 and bf16")

    @property
    def zero(self) -> ZeroConfig:
        return self.zero_optimization  # always a ZeroConfig after parsing

    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "config") -> "DeepSpeedConfig":
        try:
            return parse_dataclass(cls, data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, source) -> "DeepSpeedConfig":
        """A dict, a JSON/YAML file path, or a DeepSpeedConfig."""
        if isinstance(source, DeepSpeedConfig):
            return source
        if isinstance(source, dict):
            return cls.from_dict(source)
        if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
            path = str(source)
            return cls.from_dict(load_file(path), source=path)
        raise ConfigError(f"config: expected a dict or a path to a JSON/YAML file, got {type(source).__name__}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(cfg: DeepSpeedConfig, world_size: int, world_source: str = "world size") -> BatchSizes:
    """Any two of the three keys fix the third: train_batch = micro * accumulation * world.

    An inconsistent or under-determined set is a ConfigError that prints the numbers, the
    rule and where the world size came from.
    """
    tb, mb, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    rule = "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"
    ws = f"world size {world_size} ({world_source})"

    def bad(detail: str) -> ConfigError:
        return ConfigError(f"batch size: {detail}; the rule is {rule}")

    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * world_size:
            raise bad(f"train_batch_size {tb} != {mb} x {gas} x {world_size} = {mb * gas * world_size} "
                      f"(train_micro_batch_size_per_gpu {mb}, gradient_accumulation_steps {gas}, {ws})")
    elif tb is not None and mb is not None:
        if tb % (mb * world_size):
            raise bad(f"train_batch_size {tb} is not divisible by train_micro_batch_size_per_gpu {mb} x {ws}")
        gas = tb // (mb * world_size)
    elif tb is not None and gas is not None:
        if tb % (gas * world_size):
            raise bad(f"train_batch_size {tb} is not divisible by gradient_accumulation_steps {gas} x {ws}")
        mb = tb // (gas * world_size)
    elif tb is not None:
        gas = 1
        if tb % world_size:
            raise bad(f"train_batch_size {tb} is not divisible by {ws}")
        mb = tb // world_size
    elif mb is not None:
        gas = gas or 1
        tb = mb * gas * world_size
    else:
        raise bad("set train_batch_size or train_micro_batch_size_per_gpu (neither is in the config)")
    return BatchSizes(tb, mb, gas)
