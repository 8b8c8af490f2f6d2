"""`zero_optimization` and its offload sections.

Parsed here in full so that every stage shares one schema; stage 0 accepts a stage 1-3
section at parse time and the engine refuses an unregistered stage when it picks the
strategy. Tuning knobs of DeepSpeed's implementation that have no counterpart here are
refused unless they hold DeepSpeed's default.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, Dict, List, Literal, Optional, Union

from ..strict import ConfigError, disabled, parse_dataclass, refused, supported
from .checks import positive

logger = logging.getLogger("dslaunch.runtime")

OffloadDevice = Literal["none", "cpu", "nvme"]
ZEROPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
               "zero_quantized_gradients")


# DeepSpeed's nccl_start_alignment_factor: stage 1-2 all-gathers start 4-byte aligned, two 16-bit
# elements (zero/partition_views.py keeps the same alignment of the partitions)
GATHER_ALIGNMENT = 2


class BucketAlignmentError(ConfigError, AssertionError):
    """An allgather_bucket_size stage 1-2 cannot align: DeepSpeed's assertion, so a script that
    catches its AssertionError catches this one too."""


@dataclass
class _OffloadTarget:
    """Where offloaded tensors live; shared by offload_optimizer and offload_param."""

    device: OffloadDevice = supported("none", "cpu: host memory; nvme: files under nvme_path")
    nvme_path: Optional[str] = supported(None, "directory for the nvme files (any file system)")
    pin_memory: bool = supported(False, "page-locks the host copies when CUDA is available")

    def validate(self, path: str) -> None:
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(f"{path}.nvme_path: required when device is \"nvme\"")


# The classes DeepSpeed 0.19.8 marks as ZeRO-3 leaf modules unless the config says otherwise
# (zero_optimization.leaf_module): transformers' MoE blocks that call only the experts that got
# tokens, so that every rank gathers the whole block at once (docs/zero.md, leaf modules).
DEFAULT_LEAF_MODULE_CLASSES: List[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
DEFAULT_LEAF_MODULE_NAMES: List[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: List[str] = []


def _string_list(path: str, key: str, value) -> List[str]:
    """A list of strings, a lone string taken as a list of one (DeepSpeed's coercion), in
    order with duplicates dropped."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{path}.{key}: expected a string or a list of strings, got {value!r}")
    return list(dict.fromkeys(items))


@dataclass
class LeafModuleConfig:
    """`zero_optimization.leaf_module`: the modules marked as ZeRO-3 leaves when the engine is
    built, as deepspeed.utils.set_z3_leaf_modules (classes), set_z3_leaf_modules_by_name
    (names) and set_z3_leaf_modules_by_suffix (name_suffixes) mark them."""

    classes: Union[str, List[str]] = supported(
        factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES),
        note="class names (plain or module-qualified) whose instances are leaves; default: transformers' "
             "Mixtral, Qwen2-MoE and Qwen3-MoE sparse blocks")
    names: Union[str, List[str]] = supported(factory=list, note="module names (as named_modules() gives them)")
    name_suffixes: Union[str, List[str]] = supported(factory=list, note="suffixes of module names")

    def validate(self, path: str) -> None:
        for key in ("classes", "names", "name_suffixes"):
            setattr(self, key, _string_list(path, key, getattr(self, key)))


NVME_POOL = "NVMe buffer pools are not used here (one chunk is read ahead and one written behind); remove it"


@dataclass
class OffloadOptimizerConfig(_OffloadTarget):
    buffer_count: Any = refused(NVME_POOL, 4)
    fast_init: bool = supported(False, "no effect needed: NVMe state files are written once at the first step")
    pipeline_read: bool = supported(False, "no effect needed: the next chunk is always read during the update")
    pipeline_write: bool = supported(False, "no effect needed: the updated chunk is always written behind")
    pipeline: bool = supported(False, "older spelling of pipeline_read + pipeline_write (always on)")
    ratio: Any = refused("partial optimizer offload is not supported; the whole optimizer state is offloaded", 1.0, 1)
    super_offload: Any = refused("SuperOffload is not supported; remove it", False)
    cpuadam_cores_perc: Any = refused("CPU Adam core pinning is not supported; OMP_NUM_THREADS sets its threads",
                                      0.8)

    def __post_init__(self) -> None:
        # DeepSpeed's model sets pipeline from its two halves, and scripts read it back
        self.pipeline = bool(self.pipeline or self.pipeline_read or self.pipeline_write)


@dataclass
class OffloadParamConfig(_OffloadTarget):
    buffer_count: Any = refused(NVME_POOL, 5)
    buffer_size: Any = refused(NVME_POOL, 100_000_000, 1e8)
    max_in_cpu: Any = refused("an in-memory cache of NVMe parameters is not supported; remove it",
                              1_000_000_000, 1e9)


@dataclass
class ZeroConfig:
    """`zero_optimization`. Stage 0 is plain data parallelism (this package's engine);
    stages 1-3 are provided by strategies registered from dslaunch.runtime.zero."""

    stage: int = supported(0, "0 data parallel, 1 optimizer state, 2 + gradients, 3 + parameters partitioned")
    # false in DeepSpeed only stops copying each gradient into one preallocated buffer (memory
    # layout); what is reduced and stepped is the same, so the results are identical either way
    contiguous_gradients: bool = supported(
        True, "no effect needed: gradients are packed into reduce buckets either way; false (DeepSpeed: no "
              "preallocated gradient buffer) gives the same results")
    # Not given, it reads as DeepSpeed's default (true at stage 3 only) but runs as true at
    # every stage: overlapping changes when a reduce runs, never what it sums
    overlap_comm: Optional[bool] = supported(
        None, "gradient buckets are reduced from backward hooks as they fill (on unless false; reads as "
              "DeepSpeed's default, true at stage 3 only, when not given)")
    reduce_scatter: bool = supported(
        True, "no effect needed: each partition's gradient sum reaches its owner the same either way (DeepSpeed's "
              "stage 3 needs false for Muon; here Muon runs with either)")
    reduce_bucket_size: int = supported(500_000_000, "elements per gradient reduction")
    allgather_partitions: Any = refused(
        "false (broadcast updated partitions) is not supported: they are all-gathered", True)
    allgather_bucket_size: int = supported(500_000_000, "elements per all-gather of updated partitions (stage 1-2, "
                                                        "where it must be even, as DeepSpeed asserts)")
    use_multi_rank_bucket_allreduce: Any = refused(
        "false is not supported: each bucket is one collective for all ranks", True)
    compute_grad_norm: bool = supported(True, "stages 1-2 compute the global gradient norm at every step "
                                              "(get_global_grad_norm)")
    offload_optimizer: Optional[OffloadOptimizerConfig] = supported(
        None, "fp32 masters and optimizer state in host memory or NVMe files, stepped on the CPU")
    offload_param: Optional[OffloadParamConfig] = supported(None, "stage 3 parameter shards in host memory or "
                                                                  "NVMe files")
    sub_group_size: int = supported(1_000_000_000, "elements per optimizer chunk when stepping offloaded state")
    cpu_offload: bool = supported(False, "deprecated form of offload_optimizer: {device: cpu}")
    cpu_offload_param: bool = supported(False, "deprecated form of offload_param: {device: cpu}")
    cpu_offload_use_pin_memory: bool = supported(False, "deprecated form of pin_memory for both offloads")
    stage3_prefetch_bucket_size: int = supported(50_000_000, "elements of the next modules gathered ahead")
    stage3_param_persistence_threshold: int = supported(100_000, "parameters this small stay whole")
    stage3_model_persistence_threshold: Any = refused(
        "a cap on the total of unpartitioned parameters is not supported; lower "
        "stage3_param_persistence_threshold", 9223372036854775807)
    stage3_max_live_parameters: int = supported(1_000_000_000, "prefetching stops at this many gathered elements")
    stage3_max_reuse_distance: int = supported(1_000_000_000, "a module's parameters stay gathered from forward "
                                                              "to backward when reused within this many elements")
    stage3_gather_16bit_weights_on_model_save: bool = supported(
        False, "engine.save_16bit_model() (the HF Trainer's save_model) gathers the full weights onto rank 0")
    stage3_module_granularity_threshold: int = supported(
        0, "modules of at most this many parameters per module with parameters in their subtree become ZeRO-3 "
           "leaves (gathered whole, fewer hooks), as DeepSpeed picks them; 0: none")
    stage3_use_all_reduce_for_fetch_params: Any = refused(
        "all-reduce parameter fetching is not supported; parameters are all-gathered", False)
    stage3_allgather_sequential: Any = refused("per-parameter sequential all-gather is not supported; remove it",
                                               False)
    elastic_checkpoint: bool = supported(False, "no effect needed: every checkpoint loads at any world size and "
                                                "stage (true at stage 3: DeepSpeed's deprecation warning)")
    load_from_fp32_weights: Any = refused(
        "false (rebuild masters from the 16-bit weights) is not supported: masters load from the fp32 copies",
        True)
    # DeepSpeed 0.19.8 reads false in one place only, stages 1-2 with offload_optimizer: a trainable
    # parameter that got no gradient in the step's window stops the step (AssertionError naming
    # this key). Everywhere else false changes nothing there, nor here (unused parameters get
    # zero gradients either way), so it is accepted and acts exactly where DeepSpeed's does.
    ignore_unused_parameters: bool = supported(
        True, "false, at stages 1-2 with offload_optimizer: a trainable parameter that got no gradient "
              "since the last step stops the step with an AssertionError naming it (DeepSpeed's check)")
    legacy_stage1: Any = refused("the legacy stage 1 implementation is not supported; remove it", False)
    round_robin_gradients: bool = supported(
        False, "no effect needed: with offload each rank copies only its own gradient partition to the host, all "
               "ranks at once (what DeepSpeed's round robin achieves)")
    parameter_alignment: Any = refused("16-byte parameter alignment in flat buffers is not supported; remove it",
                                       False)
    zero_hpz_partition_size: int = supported(
        1, "ZeRO++ hpZ (stage 3): a second copy of each parameter cut over this many ranks of one host; backward "
           "gathers from it inside the host (0 or 1: off)")
    zero_quantized_weights: bool = supported(
        False, "ZeRO++ qwZ (stage 3): parameter all-gathers carry int8 blocks with fp32 scales; masters stay fp32")
    zero_quantized_nontrainable_weights: bool = supported(
        False, "ZeRO++ (stage 3): the shards of frozen parameters are kept and gathered as int8 blocks")
    zero_quantized_gradients: bool = supported(
        False, "ZeRO++ qgZ (stage 3): gradients reduce as int4 blocks, inside each host first, then across hosts")
    memory_efficient_linear: Any = refused(
        "false is not supported: stage 3 never keeps gathered weights alive for backward", True)
    pipeline_loading_checkpoint: Any = refused("pipeline-mode checkpoint loading is not supported; remove it",
                                               False)
    override_module_apply: Any = refused(
        "module.apply() does not gather stage 3 parameters here; initialise weights in the constructor or "
        "under GatheredParameters, and remove it", False)
    log_trace_cache_warnings: Any = refused("there is no trace cache to warn about here; remove it", False)
    enable_sanity_checks: bool = supported(
        False, "stage 3 checks before each collective that every rank gathers the same module "
               "(DSLAUNCH_ZERO3_CHECK=1/0 overrides)")
    save_muon_momentum_buffer_in_memory: bool = supported(
        False, "with Muon and offload_optimizer nvme: the momentum stays in host memory, out of the NVMe files")
    leaf_module: LeafModuleConfig = supported(
        factory=LeafModuleConfig, note="modules marked as ZeRO-3 leaves when the engine is built (by class, "
                                       "name or name suffix), as deepspeed.utils' set_z3_leaf_modules* calls")
    zenflow: Any = refused("ZenFlow is not supported; remove it", None)
    mics_shard_size: Any = refused("MiCS sharding is not supported (DeepSpeed removed it too); remove it", -1)
    mics_hierarchical_params_gather: Any = refused(
        "MiCS sharding is not supported (DeepSpeed removed it too); remove it", False)
    zeropp_loco_param: Any = refused("LoCo-ZeRO++ is not supported (DeepSpeed removed it too); remove it", None)
    legacy_bool: bool = field(default=False, init=False, repr=False)  # written as "zero_optimization": true
    overlap_comm_defaulted: bool = field(default=False, init=False, repr=False)  # not given: see overlaps_reduction

    ALIASES = {
        # DeepSpeed's model takes its stage-3 keys with or without the "stage3_" prefix.
        **{name[len("stage3_"):]: name for name in (
            "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
            "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
            "stage3_module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params",
            "stage3_allgather_sequential")},
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
        # "all_reduce_bucket_size" is how the GPT-lite post writes the gradient-reduction bucket.
        "all_reduce_bucket_size": "reduce_bucket_size",
        "allreduce_bucket_size": "reduce_bucket_size",
    }

    @classmethod
    def from_bool(cls, enabled: bool) -> "ZeroConfig":
        # The legacy `"zero_optimization": true` meant stage 1.
        cfg = cls(stage=1 if enabled else 0)
        cfg.legacy_bool = True
        return cfg

    def validate(self, path: str) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"{path}.stage: must be 0, 1, 2 or 3, got {self.stage}")
        for key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size"):
            positive(path, key, getattr(self, key))
        if self.stage in (1, 2) and int(self.allgather_bucket_size) % GATHER_ALIGNMENT:
            raise BucketAlignmentError(
                f"{path}.allgather_bucket_size: {self.allgather_bucket_size}: allgather_bucket_size must be a multiple "
                f"of nccl_start_alignment_factor, {GATHER_ALIGNMENT} (4-byte aligned all-gathers; DeepSpeed asserts it "
                "too)")  # short: pytest's repr of the error, which DeepSpeed's test searches, stops at 240 characters
        # 0 prefetch: every module waits for its own gather (DeepSpeed accepts 0 too)
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                    "stage3_max_reuse_distance", "zero_hpz_partition_size", "stage3_module_granularity_threshold"):
            positive(path, key, getattr(self, key), allow_zero=True)
        on = [k for k in ZEROPP_KEYS if self.zeropp_on(k)]
        if on and self.stage != 3:
            # DeepSpeed reads these only in its stage-3 optimizer and ignores them below it
            raise ConfigError(f"{path}.{on[0]}: ZeRO++ applies to ZeRO stage 3 (partitioned parameters and "
                              f"gradients); stage {self.stage} would ignore it: set stage 3 or remove it")
        self._apply_deprecated(path)
        if self.stage == 3 and self.elastic_checkpoint:  # DeepSpeed 0.19.8 warns; the key changes nothing here
            logger.warning(f"{path}.elastic_checkpoint: ZeRO-3 elastic checkpointing is deprecated in DeepSpeed "
                           "(use universal checkpointing); here every checkpoint loads at any world size and "
                           "stage, so the key has no effect")
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3  # DeepSpeed's value for scripts that read it
            self.overlap_comm_defaulted = True

    @property
    def overlaps_reduction(self) -> bool:
        """Whether gradient reduces run from backward hooks while backward goes on: unless the
        config sets overlap_comm false. Better than DeepSpeed, whose default is off below stage 3:
        overlapping moves reduces earlier and gives the same sums."""
        return self.overlap_comm or self.overlap_comm_defaulted

    def _apply_deprecated(self, path: str) -> None:
        # DeepSpeed's pre-0.5 spellings, mapped the way DeepSpeed maps them.
        if self.cpu_offload:
            if self.offload_optimizer is not None:
                raise ConfigError(f"{path}.cpu_offload: give either cpu_offload or offload_optimizer, not both")
            self.offload_optimizer = OffloadOptimizerConfig(device="cpu")
        if self.cpu_offload_param:
            if self.offload_param is not None:
                raise ConfigError(f"{path}.cpu_offload_param: give either cpu_offload_param or offload_param, "
                                  f"not both")
            self.offload_param = OffloadParamConfig(device="cpu")
        if self.cpu_offload_use_pin_memory:
            for target in (self.offload_optimizer, self.offload_param):
                if target is not None:
                    target.pin_memory = True

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device if self.offload_optimizer else "none"

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device if self.offload_param else "none"

    def zeropp_on(self, key: str) -> bool:
        """Whether ZeRO++ key `key` asks for anything (hpZ: a size above 1)."""
        value = getattr(self, key)
        return value > 1 if key == "zero_hpz_partition_size" else bool(value)

    def sanity_checks(self) -> bool:
        """enable_sanity_checks, unless DSLAUNCH_ZERO3_CHECK says otherwise."""
        env = os.environ.get("DSLAUNCH_ZERO3_CHECK", "")
        return self.enable_sanity_checks if env == "" else env != "0"


def _unprefixed(name: str) -> property:
    full = "stage3_" + name
    return property(lambda self: getattr(self, full), lambda self, value: setattr(self, full, value),
                    doc=f"DeepSpeed's attribute name for {full}.")


# DeepSpeed's model names its stage-3 fields without the prefix (the prefixed spellings are its
# aliases): a script reading config.prefetch_bucket_size gets the same field
for _name in ("prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
              "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
              "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential"):
    setattr(ZeroConfig, _name, _unprefixed(_name))


# -- DeepSpeed's names for this schema (deepspeed.runtime.zero.config and .offload_config) ----
# Scripts that build or read the section under those names get these classes (the paths are
# entries of compat/paths.py).

class _ParsedByName(type):
    """`DeepSpeedZeroConfig(**section)` builds the section as DeepSpeed's pydantic model does,
    taking every spelling it takes (stage3_ prefixes or not, the deprecated fp16 name), through
    the strict parser; an instance of ZeroConfig is an instance of it."""

    def __call__(cls, **section):
        return parse_dataclass(ZeroConfig, section, "zero_optimization")

    def __instancecheck__(cls, obj):
        return isinstance(obj, ZeroConfig)


class DeepSpeedZeroConfig(metaclass=_ParsedByName):
    """DeepSpeed's name for the `zero_optimization` section (dslaunch's ZeroConfig)."""


DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig
DeepSpeedZeroOffloadParamConfig = OffloadParamConfig


class ZeroStageEnum(IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The kinds of ZeRO state engine.offload_states() moves (DeepSpeed's names): fp32 masters,
    the module's compute-dtype parameters (stage 3: this rank's shards), optimizer state, the
    reduced gradient partitions, and a persistent contiguous gradient buffer (dslaunch keeps
    none: its reduce buckets live only during backward)."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def get_zero_config(param_dict: Dict[str, Any]) -> ZeroConfig:
    """The parsed `zero_optimization` section of a whole config dict (stage 0 if absent)."""
    section = param_dict.get("zero_optimization", {})
    if isinstance(section, bool):  # DeepSpeed's legacy `"zero_optimization": true` is stage 1
        section = {"stage": 1 if section else 0}
    return parse_dataclass(ZeroConfig, section, "zero_optimization")
