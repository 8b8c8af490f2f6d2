"""Where DeepSpeed's module paths live in dslaunch.runtime: the one alias table.

Scripts that do `import dslaunch.runtime as deepspeed` import DeepSpeed's module paths under
dslaunch.runtime (`dslaunch.runtime.zero.stage_1_and_2`, `.monitor.tensorboard`, ...), and the
`deepspeed` compatibility package maps every `deepspeed.X` to `dslaunch.runtime.X`. The runtime
itself is laid out on its own floors (core/, the strategies, train/: docs/architecture.md), so
each such path that is not a file of the runtime is answered here, by a finder that
dslaunch.runtime puts first on sys.meta_path when it is imported:

- `"x.y": "a.b"`: dslaunch.runtime.x.y *is* dslaunch.runtime.a.b, the same module object
  (class identity and module state hold: `isinstance(engine, deepspeed.runtime.engine.
  DeepSpeedEngine)`), and every child dslaunch.runtime.x.y.z is a.b.z;
- `Names(...)`: a DeepSpeed path gathering names that live in several of our modules: a
  module made here that holds exactly those objects (DeepSpeed's `deepspeed.runtime.utils`);
- `Refused(reason)`: a DeepSpeed module dslaunch does not provide: importing it is one
  ImportError line saying why and what to use instead.

The runtime's own former paths (from before the three floors) are entries too, so scripts
written against them keep working. This module imports nothing of dslaunch: the runtime
imports it first.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple, Union

PACKAGE = "dslaunch.runtime"


@dataclass(frozen=True)
class Names:
    """A module made of names found elsewhere: {name: "module" or "module:attribute"}, module
    paths relative to dslaunch.runtime; the attribute defaults to the name, and a package's
    submodule of that name is imported when the package has no such attribute yet."""

    doc: str
    names: Dict[str, str] = field(default_factory=dict)
    # set: the module's other (non-dunder) names are refused, `from m import x` being one
    # ImportError line "<deepspeed path>.x <refused>" instead of Python's bare "cannot import name"
    refused: Optional[str] = None
    # given: only these names are refused with `refused`; the others stay plain AttributeErrors
    refused_names: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Refused:
    """A module dslaunch does not provide: the ImportError message is `reason`, followed by
    the string `detail` names ("module:attribute"), when the why is kept beside the code."""

    reason: str
    detail: Optional[str] = None

    def message(self) -> str:
        if self.detail is None:
            return self.reason
        return f"{self.reason}: {_attribute(self.detail, '')}"


Entry = Union[str, Names, Refused]

# the names of deepspeed.utils' tensor-fragment calls (zero/fragments.py)
_FRAGMENTS = ("safe_get_full_fp32_param", "safe_set_full_fp32_param", "safe_get_full_optimizer_state",
              "safe_set_full_optimizer_state", "safe_get_full_grad", "safe_set_full_grad", "safe_get_local_fp32_param",
              "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state",
              "safe_get_local_grad", "safe_set_local_grad", "safe_update_full_grad_vectorized")
_TOPOLOGY = Names(
    "DeepSpeed's topology module (deepspeed.runtime.pipe.topology); the mesh lives in core/parallel/.",
    {"MeshError": "core.parallel.dims", "GroupFactory": "core.parallel.layout",
     "PipeDataParallelTopology": "core.parallel.layout", "PipeModelDataParallelTopology": "core.parallel.layout",
     "ProcessTopology": "core.parallel.layout", "TopologyError": "core.parallel.layout",
     "default_topology": "core.parallel.layout", "prime_factors": "core.parallel.layout",
     "_prime_factors": "core.parallel.layout:prime_factors",  # DeepSpeed's private name, which its tests import
     "topology_for": "core.parallel.layout", "PipelineParallelGrid": "core.parallel.mesh",
     "ProcessMesh": "core.parallel.mesh", "data_parallel_grid": "core.parallel.mesh", "new_group": "core.parallel.mesh",
     "MpuGrid": "core.parallel.mpu", "MpuMesh": "core.parallel.mpu"})

# DeepSpeed 0.19.8's AutoEP is a set of internal modules (config dataclasses, the layer, the
# router, the expert repacking, their collectives); dslaunch's AutoEP is its own code
# (runtime/moe/autoep) behind the same `expert_parallel` config section, so a script reaches it
# through deepspeed.initialize, and DeepSpeed's internal module paths are refused, each saying so.
_AUTOEP_OWN = ("is not provided: DeepSpeed's AutoEP internals have no counterpart here; dslaunch's AutoEP "
               "(dslaunch.runtime.moe.autoep) is driven by the config's expert_parallel section through "
               "deepspeed.initialize")
_AUTOEP_INTERNALS = {
    "module_inject.auto_ep": "AutoEP model surgery",
    "module_inject.auto_ep_comm": "AutoEP's all-to-all backends",
    "module_inject.auto_ep_config": "AutoEP's config and layer-spec dataclasses",
    "module_inject.auto_ep_preset_adapters": "AutoEP's per-model adapters",
    "module_inject.auto_ep_presets": "AutoEP's preset registry",
    "moe.ep_count": "AutoEP's token counting",
    "moe.ep_experts": "AutoEP's grouped experts",
    "moe.ep_kernels": "AutoEP's Triton kernels",
    "moe.ep_repack": "AutoEP's expert weight repacking",
    "moe.ep_router": "AutoEP's top-k router",
}
# AutoEP + AutoTP folding (experts and tensor slices on the same ranks): not supported here
_FOLDING = ("is not provided: AutoEP + AutoTP folding is not supported here (AutoEP runs with tensor_parallel "
            "off; the expert_parallel keys only folding reads are refused)")
# what AutoEP checkpoints do here instead of DeepSpeed's universal conversion (train/checkpoint/autoep.py)
_AUTOEP_UNIVERSAL = ("is not provided: an AutoEP checkpoint loads at the autoep_size that saved it, and its weights "
                     "alone (load_optimizer_states=False) at any autoep_size; DeepSpeed's universal conversion for "
                     "AutoEP is not built here")

# what deepspeed.runtime.zero.partition_parameters' other names get: the public ones are answered above
_ZERO_INIT_INTERNALS = ("is not provided: it is DeepSpeed's base of zero.Init, which patches module classes and, "
                        "under memory_efficient_linear, replaces torch.nn.functional.linear process-wide; "
                        "dslaunch's stage 3 frees each gathered weight after forward and gathers it again for "
                        "backward without patching torch (use deepspeed.zero.Init)")

# Path under dslaunch.runtime -> where it lives (relative to dslaunch.runtime).
PATHS: Dict[str, Entry] = {
    # -- DeepSpeed's paths whose module lives elsewhere here ------------------------------------
    "accelerator": "core.accelerator",  # deepspeed.accelerator
    "accelerator.cpu_accelerator": Names("deepspeed.accelerator.cpu_accelerator: the CPU accelerator class.",
                                         {"CPU_Accelerator": "core.accelerator.real_accelerator"}),
    # deepspeed.runtime.activation_checkpointing, its children included (.checkpointing, .offload_activations)
    "activation_checkpointing": "train.activation_checkpointing",
    "base_optimizer": Names("deepspeed.runtime.base_optimizer: the base classes of DeepSpeed's optimizer wrappers, "
                            "for isinstance checks (the engine's optimizer answers for its role).",
                            {"DeepSpeedOptimizer": "core.internals", "ZeROOptimizer": "core.internals"}),
    "bf16_optimizer": Names("DeepSpeed's bf16 optimizer wrapper, named for isinstance checks only.",
                            {"BF16_Optimizer": "core.internals"}),
    "checkpoint": "train.checkpoint",  # deepspeed.checkpoint
    "checkpointing": "train.activation_checkpointing.checkpointing",  # deepspeed.checkpointing
    "comm": "core.comm",  # deepspeed.comm
    "comm.coalesced_collectives": Names("deepspeed.runtime.comm.coalesced_collectives: ZeRO's coalesced reductions.",
                                        {"reduce_scatter_coalesced": "core.comm.coalesced",
                                         "all_to_all_quant_reduce": "core.comm.coalesced"}),
    "compression": "train.compression",  # deepspeed.compression
    "config": "core.config",  # deepspeed.runtime.config
    "config_utils": "core.config.model_base",  # deepspeed.runtime.config_utils: DeepSpeedConfigModel, helpers
    "constants": "core.config.constants",  # deepspeed.runtime.constants: config keys and their defaults
    "dataloader": "train.dataloader",  # deepspeed.runtime.dataloader
    "elasticity": "core.config.elasticity",  # deepspeed.elasticity
    "engine": "train.engine",  # deepspeed.runtime.engine
    "progressive_layer_drop": Refused(
        "deepspeed.runtime.progressive_layer_drop (ProgressiveLayerDrop) is not provided: DeepSpeed 0.19.8 removed "
        "progressive layer drop and refuses its config section, as dslaunch does"),
    "fp16": Names("deepspeed.runtime.fp16: where DeepSpeed's scripts import its loss scalers from.",
                  {"loss_scaler": "core"}),  # the module core/loss_scaler.py
    "fp16.fused_optimizer": Names("DeepSpeed's fp16 optimizer wrapper, named for isinstance checks only.",
                                  {"FP16_Optimizer": "core.internals"}),
    "fp16.loss_scaler": "core.loss_scaler",  # the engine's scaler is DeepSpeed's classes
    "fp16.onebit": Refused("deepspeed.runtime.fp16.onebit (OnebitAdam, ZeroOneAdam, OnebitLamb) is not provided",
                           "train.optim:ONE_BIT_PACKAGE"),
    "fp16.unfused_optimizer": Names("DeepSpeed's unfused fp16 optimizer wrapper, named for isinstance checks only.",
                                    {"FP16_UnfusedOptimizer": "core.internals"}),
    # deepspeed.inference.quantization: post-init group-wise int4/int8 weight quantization
    "inference.quantization": Names("deepspeed.inference.quantization: group-wise weight quantization.",
                                    {name: "inference.groupwise" for name in (
                                        "Quantizer", "DeQuantizer", "QuantizedLinear", "QuantizedEmbedding")}),
    "inference.quantization.quantization": Names(
        "deepspeed.inference.quantization.quantization: a model's layers replaced by quantized ones.",
        {"_init_group_wise_weight_quantization": "inference.groupwise"}),
    "inference.quantization.utils": Names("deepspeed.inference.quantization.utils: the group-wise (de)quantizers.",
                                          {"Quantizer": "inference.groupwise", "DeQuantizer": "inference.groupwise"}),
    "inference.quantization.layers": Names("deepspeed.inference.quantization.layers: the quantized layers.",
                                           {"QuantizedLinear": "inference.groupwise",
                                            "QuantizedEmbedding": "inference.groupwise"}),
    "lr_schedules": "train.lr_schedules",  # deepspeed.runtime.lr_schedules
    # deepspeed.module_inject: AutoTP's mode switch and the shard sizes; DeepSpeed's kernel
    # injection and its layer classes are not provided (their paths are not found)
    "module_inject": Names("deepspeed.module_inject: AutoTP's training/inference switch and its shard sizes.",
                           {"set_autotp_mode": "tensor_parallel.mode", "tp_shard": "tensor_parallel",
                            **{name: "tensor_parallel.autotp_config" for name in (
                                "AutoTPConfig", "PartitionType", "TPLayerSpec", "merge_autotp_configs")}}),
    "module_inject.autotp_config": "tensor_parallel.autotp_config",  # DeepSpeed's layer-spec objects
    "module_inject.auto_tp": "tensor_parallel.autotp_replace",  # DeepSpeed's AutoTP class (the layer-spec walk)
    "module_inject.auto_tp_model_utils": "tensor_parallel.head_helpers",  # ALiBi / attention bias per local head
    "module_inject.layers": Names("deepspeed.module_inject.layers: AutoTP's training layers (column, row, output "
                                  "head, per-sub-parameter and fused ones), the training/inference switch and the "
                                  "universal-checkpoint metadata helpers (DeepSpeed's embedding, conv and "
                                  "inference-kernel layers are not provided).",
                                  {**{n: "tensor_parallel.autotp_layers"
                                      for n in ("LinearLayer", "LinearAllreduce", "LmHeadLinearAllreduce")},
                                   **{n: "tensor_parallel.autotp_subparam_layers"
                                      for n in ("SubParamLinearLayer", "SubParamLinearAllreduce",
                                                "SubParamColumnParallel", "GateUpPack_LinearLayer",
                                                "fused_LinearLayer", "Yuan_LinearLayer", "Yuan_LinearAllreduce")},
                                   "_build_param_uc_restore_meta": "tensor_parallel.uc_meta:build_restore_meta",
                                   "_build_param_uc_conversion_meta": "tensor_parallel.uc_meta:build_conversion_meta",
                                   "_get_param_uc_conversion_meta": "tensor_parallel.uc_meta:conversion_meta",
                                   "collect_autotp_universal_checkpoint_info":
                                       "tensor_parallel.uc_meta:collect_universal_checkpoint_info",
                                   "_subparam_shard_widths": "tensor_parallel.subparams:subparam_shard_widths",
                                   "DS_AUTOTP_UC_META": "tensor_parallel.uc_keys",
                                   "AUTOTP_MODE": "tensor_parallel.mode", "set_autotp_mode": "tensor_parallel.mode",
                                   "is_autotp_training_mode": "tensor_parallel.mode",
                                   "get_auto_tp_mode": "tensor_parallel.mode:get_autotp_mode"}),
    "module_inject.tp_plan_converter": Names("deepspeed.module_inject.tp_plan_converter: a Hugging Face tp plan "
                                             "as AutoTP layer specs.",
                                             {"TPPlanConverter": "tensor_parallel.autotp_config",
                                              "SUPPORTED_STYLES": "tensor_parallel.autotp_config"}),
    "module_inject.tp_shard": "tensor_parallel.tp_shard",  # DeepSpeed's uneven (kv-head, grain) shard sizes
    "moe.sharded_moe": "moe.sharded",  # DeepSpeed's gating functions with its arguments and return values
    "moe.fused_expert_layout": Names("deepspeed.moe.fused_expert_layout: a fused gate+up expert weight's layout.",
                                     {"FusedExpertLayout": "moe.autoep.detect",
                                      "classify_fused_gate_up_layout": "moe.autoep.detect"}),
    "monitor": "train.monitor",  # deepspeed.monitor
    "monitor.comet": Names("deepspeed.monitor.comet", {"CometMonitor": "train.monitor.monitor"}),
    "monitor.config": "core.config.monitor",  # deepspeed.monitor.config: the sections live with the config
    "monitor.csv_monitor": Names("deepspeed.monitor.csv_monitor", {"csvMonitor": "train.monitor.monitor"}),
    "monitor.tensorboard": Names("deepspeed.monitor.tensorboard", {"TensorBoardMonitor": "train.monitor.monitor"}),
    "monitor.wandb": Names("deepspeed.monitor.wandb", {"WandbMonitor": "train.monitor.monitor"}),
    "ops": "train.ops",  # deepspeed.ops
    "ops.aio": Names("deepspeed.ops.aio: the async-I/O op's builder (False here: NVMe offload uses torch's file I/O).",
                     {"AsyncIOBuilder": "train.ops.op_builder"}),
    # DeepSpeed's JIT op-building code: its op builders answer here for dslaunch's own kernels
    # (ops/op_builder/), which torch.utils.cpp_extension builds; no CUDA/CUTLASS build is driven
    "ops.op_builder.builder": Refused("deepspeed.ops.op_builder.builder (OpBuilder/CUDAOpBuilder, DeepSpeed's "
                                      "nvcc/JIT op-building code) is not provided: dslaunch builds its own kernels "
                                      "with torch.utils.cpp_extension; ask deepspeed.ops.op_builder's builders "
                                      "whether an op runs here"),
    "ops.op_builder.evoformer_attn": Refused("deepspeed.ops.op_builder.evoformer_attn (DeepSpeed4Science's "
                                             "Evoformer attention, a CUTLASS CUDA kernel) is not provided"),
    "pipe.engine": "train.pipe_engine",  # deepspeed.runtime.pipe.engine
    "pipe.topology": _TOPOLOGY,
    "precision_config": Names("deepspeed.runtime.precision_config: one precision section of a config dict, parsed.",
                              {"get_bfloat16_config": "core.config", "get_float16_config": "core.config",
                               "DeepSpeedFP16Config": "core.config", "DeepSpeedBF16Config": "core.config"}),
    "profiling": "train.profiling",  # deepspeed.profiling
    "rollout": "inference.rollout",  # deepspeed.runtime.rollout: on-policy generation for RL/distillation
    # deepspeed.sequence's AutoSP for multimodal models: the ViT attention wrapper, the fusion
    # adapters, and the class-name detection with auto_wrap_model_for_sp (one module for both)
    "sequence.autosp_vit": "sequence.vit_attention",
    "sequence.autosp_fusion": "sequence.fusion",
    "sequence.autosp_detector": "sequence.autowrap",
    "sequence.auto_sp": "sequence.autowrap",
    "sequence.fpdt_layer": "sequence.fpdt",  # deepspeed.sequence.fpdt_layer: FPDT's input layout (kernels refused)
    "sequence_parallel": "sequence",  # deepspeed.runtime.sequence_parallel (ulysses_sp: the Hugging Face path)
    # deepspeed.runtime.utils and deepspeed.utils: helpers DeepSpeed gathers under one name
    "utils": Names("deepspeed.runtime.utils / deepspeed.utils: the helpers scripts call, each dslaunch's own.",
                   {"zero_to_fp32": "train.checkpoint", "clip_grad_norm_": "train.helpers",
                    "is_model_parallel_parameter": "train.helpers", "move_to_device": "train.helpers",
                    "see_memory_usage": "train.helpers", "set_random_seed": "train.helpers",
                    "call_to_str": "train.helpers", "count_used_parameters_in_backward": "train.helpers",
                    "CheckOverflow": "train.overflow_check", "get_weight_norm": "train.overflow_check",
                    "PartitionedTensor": "pipe.partitioned", "partition_uniform": "pipe.partitioned",
                    "partition_balanced": "pipe.partition", "prefix_sum_inc": "pipe.partitioned",
                    # deepspeed.utils imports its groups module, so scripts reach it as an attribute
                    "groups": "core.parallel",
                    **{name: "zero.fragments" for name in _FRAGMENTS}}),
    "utils.nvtx": "core.accelerator.nvtx",  # deepspeed.utils.nvtx: instrument_w_nvtx
    "torch_autocast": "core.autocast",  # deepspeed.runtime.torch_autocast: gradients' reduction dtypes
    "tensor_parallel.config": Names("deepspeed.runtime.tensor_parallel.config: the Hugging Face tp plan reader "
                                    "(the section itself is parsed with the config).",
                                    {"_get_hf_tp_plan": "tensor_parallel.autotp:hf_tp_plan"}),
    "sparse_tensor": Refused("deepspeed.runtime.sparse_tensor (SparseTensor, the container of DeepSpeed's sparse "
                             "embedding-gradient all-reduce) is not provided: sparse_gradients is refused, and the "
                             "engine reduces every gradient dense"),
    "swap_tensor": Names("deepspeed.runtime.swap_tensor: the size from which DeepSpeed's NVMe offload swaps.",
                         {"MIN_SWAPPABLE_BYTES": "zero.param_swap"}),
    "utils.comms_logging": Names("deepspeed.utils.comms_logging: the comms logger deepspeed.comm records into.",
                                 {"CommsLogger": "core.comm.logger", "bandwidths_gbps": "core.comm.logger",
                                  "bus_factor": "core.comm.logger"}),
    "utils.groups": "core.parallel.groups",  # deepspeed.utils.groups: answered by the mesh
    "utils.pin_memory": "core.accelerator.native_pinning",  # deepspeed.utils.pin_memory: refused native backend
    "utils.pin_memory_tracker": "core.accelerator.pin_memory_tracker",  # deepspeed.utils.pin_memory_tracker
    "utils.timer": Names("deepspeed.utils.timer: the trimmed mean of the comms logger's averages.",
                         {"trim_mean": "core.comm.logger"}),
    "utils.zero_to_fp32": "train.checkpoint.zero_to_fp32",  # the consolidation script save_checkpoint ships
    "zero.config": Names("deepspeed.runtime.zero.config: DeepSpeed's names for the zero_optimization schema.",
                         {name: "core.config.zero" for name in (
                             "DeepSpeedZeroConfig", "DeepSpeedZeroOffloadOptimizerConfig",
                             "DeepSpeedZeroOffloadParamConfig", "ZeroStageEnum", "OffloadDeviceEnum",
                             "get_zero_config")}),
    "zero.offload_config": Names("deepspeed.runtime.zero.offload_config: DeepSpeed's names for the offload sections.",
                                 {name: "core.config.zero" for name in (
                                     "OffloadDeviceEnum", "OffloadStateTypeEnum",
                                     "DeepSpeedZeroOffloadOptimizerConfig",
                                     "DeepSpeedZeroOffloadParamConfig")}),
    "zero.partition_parameters": Names("deepspeed.runtime.zero.partition_parameters: ZeRO-3's parameter names.",
                                       {"GatheredParameters": "zero.params", "Init": "zero.params",
                                        "ZeroParamStatus": "zero.params", "MultipleAllGatherHandles": "zero.params",
                                        "partitioned_param_data_shape": "zero.params",
                                        "CUDAQuantizer": "zero.zeropp",
                                        "get_allgather_dtype": "zero.params",
                                        "register_external_parameter": "zero.hook_scope",
                                        "unregister_external_parameter": "zero.hook_scope",
                                        "zero3_linear_wrap": "zero.linear",  # DeepSpeed imports it here too
                                        "_contradicting_single_rank_pg_error":  # DeepSpeed's private name
                                            "zero.params:single_rank_group_contradiction"},
                                       refused=_ZERO_INIT_INTERNALS,
                                       refused_names=("InsertPostInitMethodToModuleSubClasses", )),
    "zero.leaf_module_config": Names("deepspeed.runtime.zero.leaf_module_config: the leaf_module section's defaults.",
                                     {"DEFAULT_LEAF_MODULE_CLASSES": "core.config.zero",
                                      "DEFAULT_LEAF_MODULE_NAMES": "core.config.zero",
                                      "DEFAULT_LEAF_MODULE_NAME_SUFFIXES": "core.config.zero",
                                      "DeepSpeedZeroLeafModuleConfig": "core.config.zero:LeafModuleConfig"}),
    "zero.parameter_offload": Names(
        "deepspeed.runtime.zero.parameter_offload: the container of a stage-3 module's parameters that sees "
        "reads by name (ZeROOrderedDict) and its helper; DeepSpeed's offload coordinator is not provided.",
        {"ZeROOrderedDict": "zero.param_reads:ReadWatch", "ensure_zero_ordered_dict": "zero.param_reads"},
        refused="is not provided: dslaunch's stage 3 gathers parameters in module hooks (runtime/zero/stage3.py), "
                "not through DeepSpeed's DeepSpeedZeRoOffload; outside a forward read them with "
                "deepspeed.zero.GatheredParameters"),
    "zero.muon": "core.muon",  # deepspeed.runtime.zero.muon: DeepSpeed's Muon package
    "zero.muon.muon_optimizer": "core.muon.optimizer",  # where DeepSpeed's MuonWithAuxAdam is imported from
    "zero.utils": Names("deepspeed.runtime.zero.utils: the class DeepSpeed raises its ZeRO refusals as.",
                        {"ZeRORuntimeException": "core.errors"}),
    "zero.stage_1_and_2": Names("DeepSpeed's ZeRO-1/2 optimizer wrapper, named for isinstance checks only.",
                                {"DeepSpeedZeroOptimizer": "core.internals"}),
    # DeepSpeed's autotuner classes: dslaunch tunes from the launcher (`dslaunch --autotuning`)
    **{f"autotuning.{name}": Refused(f"deepspeed.autotuning.{name} (DeepSpeed's Autotuner, ResourceManager and "
                                     "their config helpers) is not provided: autotuning runs as `dslaunch "
                                     "--autotuning tune|run` (docs/autotuning.md), with dslaunch's own search, "
                                     "trials and memory model") for name in ("autotuner", "scheduler", "utils")},
    "checkpoint_engine": Refused("deepspeed.runtime.checkpoint_engine (DeepSpeed's pluggable checkpoint writers: "
                                 "Torch, Fast, Decoupled, DataStates) is not provided: save_checkpoint and "
                                 "load_checkpoint write and read through dslaunch's own checkpoint writer"),
    "compression.basic_layer": Refused("deepspeed.compression.basic_layer (LinearLayer_Compress and DeepSpeed's "
                                       "other replacement layers) is not provided: init_compression keeps the "
                                       "model's own layers and attaches each technique as a torch parametrization"),
    "linear": Refused("deepspeed.linear (OptimizedLinear, LoRAOptimizedLinear, init_lora: LoRA adapters over "
                      "sharded, optionally quantized base weights) is not provided; add LoRA adapters with a "
                      "library such as peft"),
    **{rel: Refused(f"deepspeed.{rel} ({what}) {_AUTOEP_OWN}") for rel, what in _AUTOEP_INTERNALS.items()},
    # the class AutoEP swaps into the model, for scripts' isinstance checks (its router, experts and
    # ep_group_name as DeepSpeed's have them); DeepSpeed's split-plan and combine helpers are not here
    "module_inject.auto_ep_layer": Names("deepspeed.module_inject.auto_ep_layer: the layer AutoEP puts in place of "
                                         "a model's MoE blocks.", {"AutoEPMoELayer": "moe.autoep.layer"},
                                         refused=_AUTOEP_OWN),
    "module_inject.auto_ep_folding": Refused(f"deepspeed.module_inject.auto_ep_folding {_FOLDING}"),
    "moe.ep_tp_dispatch": Refused(f"deepspeed.moe.ep_tp_dispatch (AutoEP's dispatch under AutoTP folding) {_FOLDING}"),
    # DeepSpeed's modules of its checkpoint-folder readers (train/checkpoint/ds_checkpoint.py, reshape3d.py)
    "checkpoint.reshape_3d_utils": Names("deepspeed.checkpoint.reshape_3d_utils: a checkpoint's (pp, tp, dp) degrees "
                                         "and which saved files each rank of smaller ones reads.",
                                         {"model_3d_desc": "train.checkpoint.reshape3d",
                                          "get_model_3d_descriptor": "train.checkpoint.ds_checkpoint",
                                          "get_model_3d_descriptor_from_metadata":
                                              "train.checkpoint.reshape3d:descriptor_from_metadata"}),
    "checkpoint.reshape_meg_2d": Names("deepspeed.checkpoint.reshape_meg_2d: model-state files per (pp, tp) cell.",
                                       {"meg_2d_parallel_map": "train.checkpoint.reshape3d",
                                        "reshape_meg_2d_parallel": "train.checkpoint.reshape3d"}),
    "checkpoint.zero_checkpoint": Names("deepspeed.checkpoint.zero_checkpoint: a folder's ZeRO files per rank.",
                                        {"ZeROCheckpoint": "train.checkpoint.ds_checkpoint"}),
    "checkpoint.deepspeed_checkpoint": Names("deepspeed.checkpoint.deepspeed_checkpoint: a Megatron-DeepSpeed "
                                             "checkpoint folder, read per rank.",
                                             {"DeepSpeedCheckpoint": "train.checkpoint.ds_checkpoint"}),
    "checkpoint.autoep_universal": Refused(f"deepspeed.checkpoint.autoep_universal {_AUTOEP_UNIVERSAL}"),
    "checkpoint.autoep_affine": Refused(f"deepspeed.checkpoint.autoep_affine (AutoEP's universal-checkpoint "
                                        f"resharding) {_AUTOEP_UNIVERSAL}"),
    "checkpoint.autoep_zero3_metadata": Refused("deepspeed.checkpoint.autoep_zero3_metadata is not provided: AutoEP "
                                                "at ZeRO stage 3 is not supported here (initialize refuses it)"),
    # -- the runtime's own former paths (before core/, the strategies and train/) --------------
    "autotuning": "train.autotuning",
    "checkpoint.errors": "core.errors",
    "checkpoint.universal_checkpoint": Names("deepspeed.checkpoint.universal_checkpoint: cutting an AutoTP "
                                             "parameter's piece out of its full tensor (the engine loads universal "
                                             "checkpoints through train.checkpoint.universal).",
                                             {"_narrow_sub_params": "train.checkpoint.autotp_restore:narrow_sub_params",
                                              "_resolve_autotp_partition":
                                                  "train.checkpoint.autotp_restore:resolve_autotp_partition",
                                              "_get_param_uc_restore_meta":
                                                  "train.checkpoint.autotp_restore:get_param_uc_restore_meta",
                                              "load_hp_checkpoint_state": "train.checkpoint.autotp_restore",
                                              "SubparamShape": "train.checkpoint.foreign"}),
    "checkpoint.reshard": "zero.reshard",
    "compiling": "train.compiling",
    "consolidate": "train.checkpoint.consolidate",  # python -m dslaunch.runtime.consolidate
    "data_parallel": "zero.stage0",
    "inference.plan": "tensor_parallel.plan",
    "inference.structure": "tensor_parallel.structure",
    "internals": "core.internals",
    "loss_scaler": "core.loss_scaler",
    "model_export": "train.model_export",
    "nonfinite": "core.nonfinite",
    "optim": "train.optim",
    "optimizer_policy": "train.optimizer_policy",
    "parallel": "core.parallel",
    "precision": "core.precision",
    "progress": "train.progress",
    "reduction": "core.reduction",
    "strategy": "core.strategy",
    "strict": "core.strict",
    "topology": _TOPOLOGY,
    "utils.helpers": "train.helpers",
    "utils.partitioned": "pipe.partitioned",
}


def is_package(rel: str) -> bool:
    """A Names module with entries below it is a package (its children are found here)."""
    prefix = rel + "."
    return any(key.startswith(prefix) for key in PATHS)


def resolve(rel: str) -> Optional[str]:
    """The real module (full name) that path `rel` under dslaunch.runtime aliases, following
    aliases of its parents; None when the table has no answer (a real file, or nothing)."""
    target = PATHS.get(rel)
    if isinstance(target, str):
        return f"{PACKAGE}.{target}"
    if target is not None:
        return None
    parent, _, leaf = rel.rpartition(".")
    if not parent:
        return None
    base = resolve(parent)
    return f"{base}.{leaf}" if base else None


def _attribute(spec: str, name: str):
    """The object `spec` names: "module:attribute", or "module" for its attribute `name` (a
    submodule when the module has no such attribute)."""
    module, _, attr = spec.partition(":")
    base = importlib.import_module(f"{PACKAGE}.{module}")
    attr = attr or name
    try:
        return getattr(base, attr)
    except AttributeError:
        return importlib.import_module(f"{base.__name__}.{attr}")


class AliasSpec(importlib.machinery.ModuleSpec):
    """An alias's spec. Its `parent` is the real module's package: runpy (`python -m <alias>`)
    resolves the real code's relative imports against it. An import never reads it (the real
    module keeps its own __package__)."""

    def __init__(self, name: str, loader, target: str, **kwargs):
        super().__init__(name, loader, **kwargs)
        self.target = target

    @property
    def parent(self):
        return self.target if self.submodule_search_locations is not None else self.target.rpartition(".")[0]


class AliasLoader(importlib.abc.Loader):
    """Loads an alias as the real module object itself (also used by the `deepspeed` package's finder)."""

    def __init__(self, target: str):
        self.target = target
        self.own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system has just stamped the alias's spec on the module; give the module
        # its own back (its __name__, __file__ and __path__ were never touched).
        module.__spec__ = self.own_spec

    def get_code(self, fullname):
        """`python -m <alias>` runs the real module's code (runpy asks for it)."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _NamesLoader(importlib.abc.Loader):
    def __init__(self, rel: str, names: Names):
        self.rel = rel
        self.names = names

    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module) -> None:
        module.__doc__ = self.names.doc
        for name, where in self.names.names.items():
            setattr(module, name, _attribute(where, name))
        module.__all__ = sorted(self.names.names)
        if self.names.refused is not None:
            module.__getattr__ = _refuse_other_names(f"deepspeed.{self.rel}", self.names.refused,
                                                     self.names.refused_names)


def _refuse_other_names(path: str, reason: str, only: Tuple[str, ...] = ()):
    """A module __getattr__ refusing every name it is asked for (or only those in `only`);
    dunder names stay plain AttributeErrors, as hasattr() and the import system probe those."""

    def __getattr__(name: str):
        if name.startswith("__") or (only and name not in only):
            raise AttributeError(f"module {path!r} has no attribute {name!r}")
        raise ImportError(f"{path}.{name} {reason}")

    return __getattr__


class _RefusingLoader(importlib.abc.Loader):
    def __init__(self, reason: str):
        self.reason = reason

    def create_module(self, spec):
        raise ImportError(self.reason)

    def exec_module(self, module) -> None:  # pragma: no cover - create_module always raises
        raise ImportError(self.reason)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Answers for dslaunch.runtime.<path> names that are entries of PATHS (or children of one)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        rel = fullname[len(PACKAGE) + 1:]
        found = PATHS.get(rel)
        if isinstance(found, Names):
            return importlib.machinery.ModuleSpec(fullname, _NamesLoader(rel, found), is_package=is_package(rel))
        if isinstance(found, Refused):
            return importlib.machinery.ModuleSpec(fullname, _RefusingLoader(found.message()))
        dest = resolve(rel)
        if dest is None or dest == fullname:
            return None
        try:
            spec = importlib.util.find_spec(dest)
        except ImportError:  # dest's parent is a plain module, or missing
            return None
        if spec is None:
            return None
        # the real file as origin: runpy makes it sys.argv[0] under `python -m <alias>`
        return AliasSpec(fullname, AliasLoader(dest), dest, origin=spec.origin,
                          is_package=spec.submodule_search_locations is not None)


_FINDER = AliasFinder()


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def top_level(name: str) -> Optional[types.ModuleType]:
    """dslaunch.runtime.<name> for a top-level entry (the runtime's module __getattr__), else None."""
    return child(PACKAGE, name)


def child(package: str, name: str) -> Optional[types.ModuleType]:
    """<package>.<name> when that path is an entry of the table, imported on first use (a
    package's module __getattr__: DeepSpeed's packages import their submodules, so a script may
    reach `deepspeed.runtime.zero.utils` as an attribute without importing it), else None."""
    rel = f"{package}.{name}"[len(PACKAGE) + 1:]
    if rel not in PATHS:
        return None
    if isinstance(PATHS[rel], Refused):  # an attribute lookup's failure, so hasattr() answers False
        raise AttributeError(PATHS[rel].message())
    return importlib.import_module(f"{package}.{name}")
