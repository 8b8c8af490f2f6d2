"""The DeepSpeed JSON config as typed dataclasses, and the batch-size rule.

Keys are spelt as DeepSpeed spells them so existing configs load unchanged. Every key
DeepSpeed documents is declared once, in its section's dataclass (this package, one module
per concern), either `supported(...)` with a note on what it does here or `refused(...)`
with the reason (see strict.py); unknown keys are refused with the nearest valid key.
`DeepSpeedConfig.load(source)` accepts a dict, a JSON/YAML path, or an already parsed
config. `python -m dslaunch.runtime.config.table` prints the key table of docs/configuration.md.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from ..strict import ConfigError, check_depth, disabled, given, load_file, parse_dataclass, refused, supported
from .checkpoint import CheckpointConfig
from .checks import positive
from .comm import COMMS_TIMEOUT_NOTE, CommsLoggerConfig
from .compression import CompressionConfig
from .compute import ActivationCheckpointingConfig, CompileConfig
from .elasticity.elasticity import engine_batch_sizes
from .expert_parallel import ExpertParallelConfig
from .monitor import DeepSpeedMonitorConfig
from .numbers import check_optimizer_params, check_scheduler_params
from .observe import (CometConfig, CSVConfig, FlopsProfilerConfig, TensorBoardConfig, TimersConfig,
                      WandbConfig)
from .parallel import ElasticityConfig, PipelineConfig, TensorParallelConfig
from .precision import (BF16Config, DataTypesConfig, FP16Config, NonFiniteCheckConfig, TorchAutocastConfig,
                        check_param_dtype, check_precision, check_master_states, dtype_named)
from .zero import OffloadDevice, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

REMOVED = "{what} is not supported (DeepSpeed removed it too); remove it"


@dataclass
class OptimizerConfig:
    type: str = supported(note="Adam (AdamW unless adam_w_mode false), AdamW, Lion, Adagrad, Lamb, Muon (with its "
                                "auxiliary Adam), CPUAdam/DeepSpeedCPUAdam, FusedAdam, CPULion, FusedLion, CPUAdagrad, "
                                "FusedLamb, SGD, RMSprop and torch.optim's others; 1-bit and muP refused with the "
                                "reason")
    params: Dict[str, Any] = supported(factory=dict, note="the optimizer's constructor arguments, checked by name")
    legacy_fusion: Any = refused("the legacy fused fp16 optimizer is not supported; remove it", False)

    # DeepSpeed reads an optimizer's arguments only from its params and ignores keys beside them
    UNKNOWN_KEY_HINT = "; optimizer arguments belong in {path}.params (DeepSpeed ignores keys beside it): move it there"

    def validate(self, path: str) -> None:
        check_optimizer_params(path or "optimizer", self.type, self.params)


@dataclass
class SchedulerConfig:
    type: str = supported(note="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest")
    params: Dict[str, Any] = supported(factory=dict, note="the schedule's arguments, checked by name")

    def validate(self, path: str) -> None:
        check_scheduler_params(path or "scheduler", self.params)


def _prefixed(exc: ConfigError, source: str) -> ConfigError:
    """The same error named after its source, keeping its class (some are also DeepSpeed's
    exception types, which scripts and DeepSpeed's tests catch)."""
    try:
        return type(exc)(f"{source}: {exc}")
    except TypeError:  # a subclass with its own constructor
        return ConfigError(f"{source}: {exc}")


class GradAccumDtypeError(ConfigError, NotImplementedError):
    """A model dtype and data_types.grad_accum_dtype this engine does not combine; also a
    NotImplementedError, the type DeepSpeed raises for the mixes it refuses."""


@dataclass
class DeepSpeedConfig:
    # -- batch ---------------------------------------------------------------------------
    train_batch_size: Optional[int] = supported(None, "global batch per optimizer step")
    train_micro_batch_size_per_gpu: Optional[int] = supported(None, "batch per rank per forward/backward")
    gradient_accumulation_steps: Optional[int] = supported(None, "micro-batches per optimizer step")
    managed_gradient_accumulation: bool = supported(
        True, "false: every backward only accumulates and every step() is the boundary (reduce and update), "
              "for scripts that own the boundary; not with pipeline parallelism, nor with an explicit "
              "overlap_comm at ZeRO stage 0 or 1 (as DeepSpeed)")
    dataloader_drop_last: bool = supported(False, "initialize()'s data loader drops the last incomplete batch")
    # -- optimizer and schedule ----------------------------------------------------------
    optimizer: Optional[OptimizerConfig] = supported(None, "built by name when initialize() gets no optimizer")
    scheduler: Optional[SchedulerConfig] = supported(None, "built by name, stepped once per optimizer step")
    zero_allow_untested_optimizer: bool = supported(
        False, "ZeRO with a client optimizer other than Adam/AdamW/SGD/Adagrad/RMSprop needs this")
    zero_force_ds_cpu_optimizer: bool = supported(
        True, "with offload_optimizer, a client optimizer without a fused CPU step is refused unless false")
    gradient_clipping: float = supported(
        1.0, "clip the global gradient norm to this (0 = off; default 1.0, as DeepSpeed)")
    # -- precision -----------------------------------------------------------------------
    fp16: FP16Config = supported(factory=FP16Config, note="")
    bf16: BF16Config = supported(factory=BF16Config, note="")
    torch_autocast: TorchAutocastConfig = supported(factory=TorchAutocastConfig, note="")
    data_types: DataTypesConfig = supported(factory=DataTypesConfig, note="")
    nonfinite_check: NonFiniteCheckConfig = supported(factory=NonFiniteCheckConfig, note="")
    amp: Any = refused("NVIDIA Apex amp is not supported (DeepSpeed removed it too); use \"fp16\" or \"bf16\"",
                       disabled)
    # -- gradient reduction --------------------------------------------------------------
    prescale_gradients: bool = supported(False, "gradients are divided by the data-parallel size before they are "
                                                "summed over it (default: after)")
    gradient_predivide_factor: float = supported(1.0, "gradients are divided by this before they are summed and by "
                                                      "(data-parallel size / this) after, at every stage")
    communication_data_type: Optional[str] = supported(None, "dtype gradients are summed in (fp32, fp16, bf16); "
                                                             "default the model dtype, as DeepSpeed")
    gradient_allreduce_op: str = supported("mean", "\"mean\" averages gradients over the data-parallel ranks, "
                                                   "\"sum\" sums them (stages 0-2; any case, as DeepSpeed)")
    disable_allgather: Any = refused("broadcast-based parameter sync is not supported; remove it", False)
    # -- ZeRO ----------------------------------------------------------------------------
    zero_optimization: Union[bool, ZeroConfig] = supported(factory=ZeroConfig, note="true = stage 1 (legacy form)")
    allgather_size: Optional[int] = supported(None, "allgather_bucket_size of the legacy \"zero_optimization\": "
                                                    "true form")
    # -- logging and monitoring ----------------------------------------------------------
    steps_per_print: float = supported(10, "rank 0 prints a progress line every this many steps (a whole "
                                           "number, or Infinity for never: Accelerate writes that)", infinite=True)
    wall_clock_breakdown: bool = supported(False, "forward/backward/step times in the progress line and monitors")
    memory_breakdown: bool = supported(False, "rank 0 prints memory in use after forward, backward and step")
    dump_state: bool = supported(False, "rank 0 prints the resolved config and engine state after initialize")
    log_level: Optional[str] = supported(None, "\"warning\" or higher silences the start-up and progress lines")
    disable_python_gc: bool = supported(False, "gc.collect() once, then Python's cyclic GC is off until "
                                               "engine.destroy()")
    vocabulary_size: Optional[int] = supported(None, "a warning when not a multiple of 8 (tensor-core alignment)")
    timers: TimersConfig = supported(factory=TimersConfig, note="")
    tensorboard: TensorBoardConfig = supported(factory=TensorBoardConfig, note="")
    wandb: WandbConfig = supported(factory=WandbConfig, note="")
    csv_monitor: CSVConfig = supported(factory=CSVConfig, note="")
    comet: CometConfig = supported(factory=CometConfig, note="")
    comms_logger: CommsLoggerConfig = supported(factory=CommsLoggerConfig, note="")
    comms_timeout: Optional[float] = supported(None, COMMS_TIMEOUT_NOTE)
    flops_profiler: FlopsProfilerConfig = supported(factory=FlopsProfilerConfig, note="")
    # -- memory and compute --------------------------------------------------------------
    activation_checkpointing: ActivationCheckpointingConfig = supported(factory=ActivationCheckpointingConfig,
                                                                        note="read by deepspeed.checkpointing")
    compile: CompileConfig = supported(factory=CompileConfig, note="")
    compression_training: CompressionConfig = supported(
        factory=CompressionConfig, note="pruning and quantization-aware training (init_compression / "
                                        "redundancy_clean, runtime/train/compression/)")
    # -- layout --------------------------------------------------------------------------
    elasticity: ElasticityConfig = supported(factory=ElasticityConfig, note="")
    pipeline: PipelineConfig = supported(factory=PipelineConfig, note="")
    sequence_parallel_size: int = supported(1, "Ulysses sequence-parallel degree: ranks sharing one sequence (the "
                                                  "mesh's sequence axis); the batch counts data-parallel ranks only, "
                                                  "gradients are averaged over data x sequence")
    data_parallel_size: Optional[int] = supported(None, "DeepSpeed's data-parallel size beside sequence_parallel_size "
                                                        "(its data x sequence mesh is built from the two); checked: "
                                                        "it must be what the world leaves after the other axes")
    seq_parallel_communication_data_type: Any = refused(
        "the Ulysses all-to-alls send activations in their own dtype (no separate communication dtype); remove it",
        "fp32")
    tensor_parallel: TensorParallelConfig = supported(factory=TensorParallelConfig, note="")
    expert_parallel: ExpertParallelConfig = supported(factory=ExpertParallelConfig, note="")
    use_data_before_expert_parallelism: Any = refused(
        "expert groups are laid out only DeepSpeed's default way (expert-parallel ranks consecutive); remove it", False)
    hybrid_engine: Any = refused("the RLHF hybrid engine is not supported; remove it", disabled)
    # -- checkpoints ---------------------------------------------------------------------
    checkpoint: CheckpointConfig = supported(factory=CheckpointConfig, note="")
    datastates_ckpt: Any = refused("DataStates asynchronous checkpointing is not supported; remove it", None)
    # -- not supported -------------------------------------------------------------------
    autotuning: Any = refused("read by `dslaunch --autotuning tune|run`, not by the engine: launch with that "
                              "option, or remove the section (the tuned ds_config_optimal.json has none)", disabled)
    aio: Any = refused("libaio tuning is not supported (NVMe offload uses plain file reads and writes on "
                       "threads); remove it", disabled)
    weight_quantization: Any = refused("weight quantization for training is not supported; remove it", None)
    data_efficiency: Any = refused("the data efficiency library (curriculum learning, random-LTD) is not "
                                   "supported; remove it", disabled)
    curriculum_learning: Any = refused(REMOVED.format(what="top-level curriculum learning"), disabled)
    progressive_layer_drop: Any = refused(REMOVED.format(what="progressive layer drop"), disabled)
    sparse_attention: Any = refused(REMOVED.format(what="sparse attention"), None)
    sparse_gradients: Any = refused(REMOVED.format(what="sparse embedding gradient compression"), False)
    eigenvalue: Any = refused(REMOVED.format(what="eigenvalue-based quantization"), disabled)
    quantize_training: Any = refused(REMOVED.format(what="mixture-of-quantization training"), disabled)
    nebula: Any = refused(REMOVED.format(what="Nebula checkpointing"), disabled)
    graph_harvesting: Any = refused(REMOVED.format(what="graph harvesting"), False)

    ALIASES = {"bfloat16": "bf16"}

    def validate(self, path: str) -> None:
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            positive(path, key, getattr(self, key))
        positive(path, "gradient_clipping", self.gradient_clipping, allow_zero=True)
        positive(path, "sequence_parallel_size", self.sequence_parallel_size)
        if self.data_parallel_size is not None:
            positive(path, "data_parallel_size", self.data_parallel_size)
        positive(path, "steps_per_print", self.steps_per_print)
        if self.steps_per_print != float("inf") and not float(self.steps_per_print).is_integer():
            raise ConfigError(f"{path + '.' if path else ''}steps_per_print: must be a whole number of steps "
                              f"(or Infinity for never), got {self.steps_per_print}")
        positive(path, "comms_timeout", self.comms_timeout)
        check_precision(self.fp16, self.bf16, self.torch_autocast)
        check_param_dtype(self.data_types.param_dtype, self.fp16.enabled, self.bf16.enabled)
        self._check_immediate_grad_update()
        if self.data_types.buffer_dtype is not None and not (self.fp16.enabled or self.bf16.enabled):
            # DeepSpeed casts buffers only inside its fp16/bf16 branch, so there it is read and unused
            raise ConfigError("data_types.buffer_dtype: applies only with fp16 or bf16 enabled (under fp32 "
                              "training buffers keep their dtype); remove it")
        if self.torch_autocast.enabled and self.zero_optimization.zero_quantized_weights:
            # DeepSpeed asserts the same when it sets up autocast
            raise ConfigError("torch_autocast.enabled: cannot be combined with zero_optimization.zero_quantized_weights "
                              "(as in DeepSpeed); choose one")
        check_master_states(self.fp16, self.bf16, self.zero_optimization.stage,
                            self.zero_optimization.offload_optimizer_device, self.torch_autocast)
        self._check_reduction()
        if self.allgather_size is not None:
            if not self.zero_optimization.legacy_bool:
                raise ConfigError("allgather_size: only read with the legacy \"zero_optimization\": true form; "
                                  "use zero_optimization.allgather_bucket_size")
            self.zero_optimization.allgather_bucket_size = self.allgather_size
        if self.compression_training.enabled and self.zero_optimization.stage == 3:
            raise ConfigError("compression_training: works with ZeRO stages 0-2 (masks on the full parameters); "
                              "ZeRO-3 partitions them, so use stage 2 or remove compression_training")
        if self.log_level is not None and self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    def _check_immediate_grad_update(self) -> None:
        import torch

        if not self.bf16.immediate_grad_update:
            return
        # DeepSpeed's BF16_Optimizer, the only reader of the key, runs exactly here
        if not (self.bf16.enabled and self.zero_optimization.stage == 1 and self.grad_accum_dtype == torch.float32
                and self.zero_optimization.offload_optimizer_device == "none"):
            raise ConfigError("bf16.immediate_grad_update: only read at ZeRO stage 1 with bf16, data_types."
                              "grad_accum_dtype fp32 and no offload_optimizer (DeepSpeed's bf16 optimizer); "
                              "elsewhere it changes nothing: remove it")

    def _check_reduction(self) -> None:
        if not self.gradient_predivide_factor > 0:
            raise ConfigError(f"gradient_predivide_factor: must be > 0, got {self.gradient_predivide_factor}")
        if self.prescale_gradients and self.gradient_predivide_factor != 1.0:
            # DeepSpeed reads the factor only without prescaling: accepting both would ignore one
            raise ConfigError("gradient_predivide_factor: has no effect with prescale_gradients true (gradients are "
                              "then divided by the data-parallel size before the sum); set one of the two")
        if self.communication_data_type is not None:
            dtype_named("communication_data_type", self.communication_data_type, COMM_DTYPES)
        self._check_allreduce_op()
        accum = self.grad_accum_dtype
        if accum is None:
            return
        import torch

        model = torch.float16 if self.fp16.enabled else torch.bfloat16 if self.bf16.enabled else torch.float32
        name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
        # each message ends in a fixed reason, which docs/configuration.md lists among the refused combinations
        if self.zero_optimization.stage == 0 and accum != model:
            # stage 0 accumulates the full gradients in param.grad, in the model dtype (DeepSpeed
            # refuses other mixes there too); stage 1 keeps a separate param.grad_accum
            # (zero/stage12.py), stages 2-3 partitions in the key's dtype
            raise GradAccumDtypeError(f"data_types.grad_accum_dtype: stage 0 accumulates gradients in the model dtype "
                              f"({name[model]}), not {name[accum]}: stage 0 sums micro-batch gradients in the "
                              "parameters' own .grad; another dtype needs ZeRO stage 1, 2 or 3, or remove the key")

    def _check_allreduce_op(self) -> None:
        op = self.gradient_allreduce_op.lower() if isinstance(self.gradient_allreduce_op, str) else None
        if op not in ALLREDUCE_OPS:
            raise ConfigError(f"Invalid gradient_allreduce_op {self.gradient_allreduce_op!r}: use "
                              f"{' or '.join(repr(o) for o in ALLREDUCE_OPS)}")
        self.gradient_allreduce_op = op
        if op != "sum":
            return
        if self.zero_optimization.stage == 3:
            raise ConfigError("gradient_allreduce_op: \"sum\" is not supported with ZeRO stage 3 (as in DeepSpeed); "
                              "use \"mean\" or stage 0-2")
        # a sum divides by nothing: accepting these would ignore them (DeepSpeed ignores them silently)
        if self.prescale_gradients:
            raise ConfigError("prescale_gradients: has no effect with gradient_allreduce_op \"sum\" (nothing is "
                              "divided); set one of the two")
        if self.gradient_predivide_factor != 1.0:
            raise ConfigError("gradient_predivide_factor: has no effect with gradient_allreduce_op \"sum\" "
                              "(nothing is divided); set one of the two")

    @property
    def communication_dtype(self):
        """The torch dtype of communication_data_type, or None (the model dtype)."""
        if self.communication_data_type is None:
            return None
        return dtype_named("communication_data_type", self.communication_data_type, COMM_DTYPES)

    # DeepSpeed's config object keeps the data_types keys flat, as their spellings
    @property
    def param_dtype(self) -> Optional[str]:
        return self.data_types.param_dtype

    @property
    def buffer_dtype(self) -> Optional[str]:
        return self.data_types.buffer_dtype

    @property
    def keep_in_fp32_modules(self):
        return self.data_types.keep_in_fp32_modules

    @property
    def grad_accum_dtype(self):
        """The torch dtype of data_types.grad_accum_dtype, or None (the stage's default)."""
        if self.data_types.grad_accum_dtype is None:
            return None
        return dtype_named("data_types.grad_accum_dtype", self.data_types.grad_accum_dtype)

    @property
    def monitor_config(self):
        """The four monitor sections together, as DeepSpeed's config gives them (for
        deepspeed.monitor.monitor.MonitorMaster)."""
        return DeepSpeedMonitorConfig(self.tensorboard, self.wandb, self.csv_monitor, self.comet)

    @property
    def nonfinite_guard(self) -> bool:
        """Whether runtime/core/nonfinite.py watches fp32/bf16 steps (fp16 has its loss scaler).
        A config that writes bf16.check_grad_overflow and not nonfinite_check asks for
        DeepSpeed's bf16 answer (skip every non-finite step, or apply it), so the guard stays out."""
        if self.fp16.enabled or not self.nonfinite_check.enabled:
            return False
        return given(self, "nonfinite_check") or not (self.bf16.enabled and given(self.bf16, "check_grad_overflow"))

    def skips_nonfinite_steps(self) -> bool:
        """Whether a step whose global gradient norm is NaN or infinite is skipped (and counted
        in skipped_steps) rather than applied: fp16 (the loss scaler), bf16 with
        check_grad_overflow (at every ZeRO stage; DeepSpeed reads it at stages 1-2 only), or
        the guard. Otherwise, as DeepSpeed, the update is applied."""
        return (self.fp16.enabled or (self.bf16.enabled and self.bf16.check_grad_overflow)
                or self.nonfinite_guard)

    @property
    def quiet(self) -> bool:
        """log_level asks for warnings and errors only."""
        return self.log_level is not None and LOG_LEVELS.index(self.log_level.lower()) > LOG_LEVELS.index("info")

    @classmethod
    def from_dict(cls, data: Dict[str, Any], source: str = "config") -> "DeepSpeedConfig":
        check_depth(data, source)  # a script's dict too: the parse below recurses
        try:
            return parse_dataclass(cls, data)
        except ConfigError as exc:
            raise _prefixed(exc, source) from None

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

    def get(self, key: str, default=None):
        """Dict-style read of a top-level section: DeepSpeed's `engine.config` is a dict, and
        the HF Trainer reads it as one (`engine.config.get("zero_optimization", {})`)."""
        return self.to_dict().get(key, default)



_schema_init = DeepSpeedConfig.__init__


def _deepspeed_style_init(self, config=None, mpu=None, mesh_device=None, **fields) -> None:
    """DeepSpeedConfig(config, mpu=None, mesh_device=None), DeepSpeed's constructor, beside
    the dataclass's own keyword form (DeepSpeedConfig(train_batch_size=8, ...)).

    `config` is a dict or a JSON/YAML path, parsed and checked as load() does. As in
    DeepSpeed, the three batch-size keys come out resolved against the data-parallel size:
    the mpu's, else the world's once torch.distributed is up, else 1.
    """
    if config is None:
        if mpu is not None or mesh_device is not None:
            raise ConfigError("DeepSpeedConfig: mpu/mesh_device given without a config")
        _schema_init(self, **fields)
        return
    if fields:
        raise ConfigError(f"DeepSpeedConfig: a config and keyword fields ({', '.join(sorted(fields))}) together; "
                          "pass one")
    if mesh_device is not None:
        raise ConfigError("DeepSpeedConfig: mesh_device is not supported; the engine builds its mesh from the config "
                          "and mpu")
    parsed = DeepSpeedConfig.load(config)
    _schema_init(self, **{f.name: getattr(parsed, f.name) for f in dataclasses.fields(DeepSpeedConfig) if f.init})
    self.world_size, self._dp_source = 1, "no process group"
    if mpu is not None:
        self.world_size, self._dp_source = mpu.get_data_parallel_world_size(), "mpu"
    elif _world_size() is not None:
        self.world_size, self._dp_source = _world_size(), "world size"
    if self.train_batch_size is None and self.train_micro_batch_size_per_gpu is None:
        return  # nothing to resolve (an inference or partial config)
    self._configure_train_batch_size()


def _configure_train_batch_size(self) -> None:
    """DeepSpeed's name: fill in the batch-size key left unset from the other two and check
    the three against the data-parallel size (`world_size`, as DeepSpeed calls it: the one the
    DeepSpeed-style constructor found, else 1). A BatchSizeError (an AssertionError, as
    DeepSpeed's) when they disagree."""
    sizes = resolve_batch_sizes(self, getattr(self, "world_size", 1), getattr(self, "_dp_source", "no process group"))
    self.train_batch_size = sizes.train_batch_size
    self.train_micro_batch_size_per_gpu = sizes.micro_batch_per_gpu
    self.gradient_accumulation_steps = sizes.gradient_accumulation_steps


DeepSpeedConfig.__init__ = _deepspeed_style_init
DeepSpeedConfig._configure_train_batch_size = _configure_train_batch_size


def _world_size() -> Optional[int]:
    """The default process group's size, or None before torch.distributed is up. Asked of
    torch.distributed itself: the config is below the communication layer and imports none of it."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None

def get_bfloat16_config(param_dict: Dict[str, Any]) -> BF16Config:
    """The `bf16` section of a config dict, parsed exactly as a full config would (same checks,
    same defaults, the old "bfloat16" spelling included): DeepSpeed's scripts and tests read one
    section without building a whole config (`deepspeed.runtime.precision_config`)."""
    section = {k: param_dict[k] for k in ("bf16", "bfloat16") if k in param_dict}
    return DeepSpeedConfig.from_dict(section).bf16


def get_float16_config(param_dict: Dict[str, Any]) -> FP16Config:
    """The `fp16` section of a config dict, parsed as get_bfloat16_config parses `bf16`."""
    section = {"fp16": param_dict["fp16"]} if "fp16" in param_dict else {}
    return DeepSpeedConfig.from_dict(section).fp16


# DeepSpeed's names for the `optimizer.type` values (scripts compare against them).
ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

# DeepSpeed accepts exactly these spellings for communication_data_type (any case).
COMM_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
ALLREDUCE_OPS = ("mean", "sum")
__all__ = ["DeepSpeedConfig", "ZeroConfig", "OptimizerConfig", "SchedulerConfig", "FP16Config", "BF16Config",
           "OffloadOptimizerConfig", "OffloadParamConfig", "OffloadDevice", "BatchSizes", "resolve_batch_sizes",
           "ConfigError"]


class BatchSizeError(ConfigError, AssertionError):
    """Batch-size keys that do not fit together or the data-parallel size; also an
    AssertionError, the type DeepSpeed raises for them."""


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


def _filled_by_accelerate_for_one_process() -> bool:
    """The Hugging Face Trainer (through Accelerate) fills "auto" batch keys with its own world
    size, and on a CPU-only machine Accelerate sees a world of 1 under DeepSpeed."""
    if "accelerate" not in sys.modules:
        return False
    import torch

    return not torch.cuda.is_available()


def resolve_batch_sizes(cfg: DeepSpeedConfig, dp_size: int, dp_source: str = "world size") -> BatchSizes:
    """Any two of the three keys fix the third: train_batch = micro * accumulation * dp,
    where dp is the data-parallel size (the world size unless pipeline or tensor
    parallelism splits the model over several ranks).

    An inconsistent or under-determined set is a ConfigError that prints the numbers, the
    rule and where the data-parallel size came from (`dp_source`). With `elasticity.enabled`
    the elastic batch sizes for this data-parallel size are used instead (deepspeed.elasticity).
    """
    if cfg.elasticity.enabled:
        return BatchSizes(*engine_batch_sizes(cfg, dp_size))
    tb, mb, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    world_size = dp_size
    rule = "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size"
    ws = f"data-parallel size {dp_size} ({dp_source})"

    def bad(detail: str) -> ConfigError:
        return BatchSizeError(f"batch size: {detail}; the rule is {rule}")

    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * world_size:
            if tb == mb * gas and _filled_by_accelerate_for_one_process():
                raise BatchSizeError(
                    f"batch size: train_batch_size {tb} = {mb} x {gas} x 1 was filled in (\"auto\") for a world of "
                    f"1 process, but this is {ws}: on a machine without GPUs Accelerate starts no process group "
                    "for DeepSpeed. Before TrainingArguments: os.environ[\"ACCELERATE_USE_DEEPSPEED\"] = \"true\"; "
                    "accelerate.PartialState(backend=\"gloo\"); then TrainingArguments(..., "
                    "accelerator_config={\"use_configured_state\": True})")
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

from .getters import get_gradient_clipping, get_log_level  # noqa: E402  (DeepSpeed's one-key readers)


# -- DeepSpeed's pydantic model names for the precision sections (deepspeed.runtime.precision_config)
# `DeepSpeedFP16Config(**section)` builds the section through the strict parser (the same checks
# a whole config gets); an FP16Config is an instance of it. DeepSpeed's models raise pydantic's
# ValidationError on a bad value, and scripts catch that type: where pydantic is installed (it
# always is beside DeepSpeed) the one-line ConfigError is raised as a ValidationError holding
# that line; without pydantic the ConfigError itself is raised.

def _as_validation_error(title: str, section: Dict[str, Any], exc: ConfigError) -> Exception:
    try:
        from pydantic import ValidationError
    except ImportError:
        return exc
    message = str(exc)
    field = next((k for k in section if f".{k}:" in message), None)
    loc = (field,) if field is not None else ()
    return ValidationError.from_exception_data(title, [{
        "type": "value_error", "loc": loc, "input": section.get(field, section),
        "ctx": {"error": ValueError(message)}}])


class _SectionByName(type):
    def __call__(cls, **section):
        try:
            return cls._parse(section)
        except ConfigError as exc:
            raise _as_validation_error(cls.__name__, section, exc) from exc

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls._parsed)


class DeepSpeedFP16Config(metaclass=_SectionByName):
    """DeepSpeed's name for the `fp16` section (dslaunch's FP16Config)."""

    _parsed = FP16Config

    @staticmethod
    def _parse(section: Dict[str, Any]) -> FP16Config:
        return get_float16_config({"fp16": section})


class DeepSpeedBF16Config(metaclass=_SectionByName):
    """DeepSpeed's name for the `bf16` section (dslaunch's BF16Config)."""

    _parsed = BF16Config

    @staticmethod
    def _parse(section: Dict[str, Any]) -> BF16Config:
        return get_bfloat16_config({"bf16": section})
