"""List every config key DeepSpeed reads, from its own config classes and constants.

Run with the reference DeepSpeed's interpreter (never a dependency of ours):

    /work/ds-venv/bin/python scripts/deepspeed_config_keys.py tests/data/deepspeed_config_keys.txt

tests/runtime/core/test_config_keys.py checks that every listed key is declared by our config (as
supported or refused), so a DeepSpeed key can never fall through to "unknown key".
Keys come from: the pydantic models (field names and their aliases), the constants the
dict-reading sections use, and the keys DeepSpeed itself rejects as removed. Sections that
we refuse as a whole are listed by their top-level name only.
"""
from __future__ import annotations

import sys


def _model_keys(model, prefix: str):
    out = []
    for name, info in model.model_fields.items():
        if info.exclude:
            continue
        out.append(prefix + (info.alias or name))
        if info.alias and info.alias != name:
            out.append(prefix + name)
    return out


def main() -> None:
    import deepspeed
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime import config as rc
    from deepspeed.runtime import constants as c
    from deepspeed.runtime.activation_checkpointing import config as ac
    from deepspeed.profiling import constants as pc
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    keys = set()
    top = [v for k, v in vars(c).items() if k.isupper() and isinstance(v, str) and not k.endswith(("_DEFAULT", "FORMAT"))
           and k in ("TRAIN_BATCH_SIZE", "TRAIN_MICRO_BATCH_SIZE_PER_GPU", "GRADIENT_ACCUMULATION_STEPS",
                     "MANAGED_GRADIENT_ACCUMULATION", "OPTIMIZER", "SCHEDULER", "ZERO_ALLOW_UNTESTED_OPTIMIZER",
                     "ZERO_FORCE_DS_CPU_OPTIMIZER", "STEPS_PER_PRINT", "TORCH_AUTOCAST", "COMMUNICATION_DATA_TYPE",
                     "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE", "PRESCALE_GRADIENTS", "GRADIENT_PREDIVIDE_FACTOR",
                     "GRADIENT_ALLREDUCE_OP", "DISABLE_ALLGATHER", "DISABLE_PYTHON_GC", "CHECKPOINT", "DATA_TYPES",
                     "DATALOADER_DROP_LAST", "USE_DATA_BEFORE_EXPERT_PARALLEL", "LOG_LEVEL", "MEMORY_BREAKDOWN",
                     "VOCABULARY_SIZE", "GRADIENT_CLIPPING", "DUMP_STATE", "WALL_CLOCK_BREAKDOWN")]
    keys.update(top)
    keys.update(["fp16", "bf16", "zero_optimization", "activation_checkpointing", "flops_profiler", "comms_logger",
                 "tensorboard", "wandb", "csv_monitor", "comet", "compile", "timers", "pipeline", "hybrid_engine",
                 "autotuning", "aio", "tensor_parallel", "expert_parallel", "weight_quantization",
                 "data_efficiency", "datastates_ckpt", "sequence_parallel_size", "bfloat16", "allgather_size"])
    keys.update(rc._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    keys.update("zero_optimization." + k for k in rc._REMOVED_ZERO_CONFIG_KEYS)
    keys.update(["optimizer.type", "optimizer.params", "optimizer.legacy_fusion", "scheduler.type",
                 "scheduler.params"])
    for model, prefix in ((DeepSpeedFP16Config, "fp16."), (DeepSpeedBF16Config, "bf16."),
                          (DeepSpeedZeroConfig, "zero_optimization."),
                          (DeepSpeedZeroOffloadOptimizerConfig, "zero_optimization.offload_optimizer."),
                          (DeepSpeedZeroOffloadParamConfig, "zero_optimization.offload_param."),
                          (TensorBoardConfig, "tensorboard."), (WandbConfig, "wandb."), (CSVConfig, "csv_monitor."),
                          (CometConfig, "comet."), (CommsLoggerConfig, "comms_logger."), (CompileConfig, "compile."),
                          (DeepSpeedThroughputTimerConfig, "timers.throughput.")):
        keys.update(_model_keys(model, prefix))
    keys.update("activation_checkpointing." + v for k, v in vars(ac).items()
                if k.startswith("ACT_CHKPT_") and isinstance(v, str) and not k.endswith("_DEFAULT") and k != "ACT_CHKPT")
    keys.update("flops_profiler." + v for k, v in vars(pc).items()
                if k.startswith("FLOPS_PROFILER_") and isinstance(v, str) and not k.endswith(("_DEFAULT", "FORMAT")))
    keys.update("torch_autocast." + k for k in ("enabled", "dtype", "lower_precision_safe_modules"))
    keys.update("data_types." + k for k in (c.GRAD_ACCUM_DTYPE, c.PARAM_DTYPE, c.BUFFER_DTYPE, c.KEEP_IN_FP32_MODULES))
    keys.update("checkpoint." + k for k in (c.CHECKPOINT_TAG_VALIDATION, c.LOAD_UNIVERSAL_CHECKPOINT,
                                            c.USE_NODE_LOCAL_STORAGE_CHECKPOINT, c.CHECKPOINT_PARALLEL_WRITE,
                                            "checkpoint_serialization", "writer"))
    keys.update("pipeline." + k for k in rc.get_pipeline_config({}))
    import dataclasses

    from deepspeed.module_inject.auto_ep_presets.base import AutoEPConfig

    keys.update("expert_parallel." + f.name for f in dataclasses.fields(AutoEPConfig) if not f.name.startswith("_"))
    # Elasticity: removed from this DeepSpeed, documented by the versions that had it.
    keys.update("elasticity." + k for k in ("enabled", "max_train_batch_size", "micro_batch_sizes", "min_gpus",
                                            "max_gpus", "min_time", "version", "ignore_non_elastic_batch_info",
                                            "prefer_larger_batch", "num_gpus_per_node", "model_parallel_size"))
    lines = [f"# DeepSpeed {deepspeed.__version__} config keys (scripts/deepspeed_config_keys.py)"] + sorted(keys)
    with open(sys.argv[1], "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
