"""How the job is laid out: `pipeline` (the pipeline engine's section) and `tensor_parallel`
(AutoTP training); `elasticity` (batch sizes that fit many world sizes) is elasticity/config.py's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..strict import ConfigError, refused, supported
from .checks import positive
from .elasticity.config import ElasticityConfig  # noqa: F401  (its section, beside its arithmetic)
from .partition import TensorParallelError, parse_partition_config


@dataclass
class PipelineConfig:
    """DeepSpeed's `pipeline` section (read by the pipeline engine)."""

    stages: Any = refused("not read from the config; give PipelineModule(num_stages=...)", "auto")
    partition: Any = refused("not read from the config; give PipelineModule(partition_method=...)", "best")
    seed_layers: Any = refused("not read from the config; give PipelineModule(seed_layers=...)", False)
    activation_checkpoint_interval: int = supported(
        0, "when > 0, replaces PipelineModule(activation_checkpoint_interval=): every N layers are recomputed in backward")
    use_reentrant: Optional[bool] = supported(
        None, "the checkpoint function of the checkpointed layers: false is deepspeed.checkpointing."
              "non_reentrant_checkpoint, true the reentrant deepspeed.checkpointing.checkpoint unless "
              "PipelineModule(activation_checkpoint_func=) gave one (with the first stage's inputs made to "
              "require grad, as DeepSpeed does); unset keeps PipelineModule(activation_checkpoint_func=), or "
              "torch's non-reentrant checkpoint")
    pipe_partitioned: bool = supported(True, "no effect needed: training has no tensor-parallel group to split "
                                             "activations over, so they go between stages whole")
    grad_partitioned: bool = supported(True, "no effect needed: as pipe_partitioned, for the gradients sent back")
    # not a DeepSpeed key (its pipeline engine always runs 1F1B): the schedule's name is
    # checked by the pipeline engine, which knows the schedules (the config may not import pipe/)
    schedule: str = supported("1f1b", "dslaunch's: the pipeline schedule by name, \"1f1b\" (DeepSpeed's), \"zb-h1\" "
                                      "(zero-bubble: backward split into input- and weight-gradient passes) or "
                                      "\"interleaved-1f1b\" (PipelineModule(virtual_stages=v > 1))")

    def validate(self, path: str) -> None:
        positive(path, "activation_checkpoint_interval", self.activation_checkpoint_interval, allow_zero=True)


@dataclass
class TPGroupConfig:
    """DeepSpeed's `tensor_parallel.tp` subsection (inference's TP settings, shared by training)."""

    tp_size: int = supported(1, "1 or equal to autotp_size (the tensor degree is autotp_size)")
    tp_grain_size: int = refused("uneven tensor-parallel splits are not supported; remove it", 1)
    mpu: Any = refused("give the mpu to initialize(mpu=...)", None)
    tp_group: Any = refused("the tensor group comes from the process mesh; remove it", None)


@dataclass
class TensorParallelConfig:
    """DeepSpeed's `tensor_parallel` section for AutoTP training (`tensor_parallel.autotp_size`)."""

    ALIASES = {"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject"}

    autotp_size: int = supported(0, "tensor-parallel degree of AutoTP training (0 or 1: off); the model's "
                                    "linear layers are sharded over the mesh's tensor axis at initialize")
    partition_config: Optional[Dict[str, Any]] = supported(
        None, "DeepSpeed's layer_specs ({patterns, partition_type: column|row|skip, gather_output, shape, "
              "partition_dim, model_types, grad_allreduce}), strict_mode and lm_head_patterns decide each layer's "
              "split; a pattern that matches nothing is an error")
    dtype: Any = supported(None, "checked against the engine's precision (fp16/bf16/fp32 come from those "
                                 "sections); a different dtype is refused")
    tensor_parallel: TPGroupConfig = supported(factory=TPGroupConfig, note="")
    injection_policy_tuple: Any = refused("give partition_config layer_specs instead", None)
    preset_model: Any = refused("presets are not provided; the built-in layouts (Llama/Mistral, GPT-2, GPT-Neo/J, "
                                "BERT, T5) and partition_config cover them", None)
    tp_overlap_comm: bool = refused("overlapping the tensor-parallel all-reduce is not supported; remove it", False)
    vocab_parallel_lm_head: Any = refused("the LM head is sharded by the built-in layouts when it is large enough; "
                                          "remove it", None)
    vocab_parallel_ce_backend: Any = refused("only the torch cross-entropy is used; remove it", "torch")
    keep_module_on_host: bool = refused("training keeps modules on the training device; remove it", False)
    replace_with_kernel_inject: bool = refused("kernel injection is for init_inference; remove it", False)

    @property
    def size(self) -> int:
        return max(int(self.autotp_size), 1)

    def validate(self, path: str) -> None:
        positive(path, "autotp_size", self.autotp_size, allow_zero=True)
        if self.partition_config is not None:
            try:
                parse_partition_config(self.partition_config)
            except TensorParallelError as exc:
                raise ConfigError(f"{path}.{str(exc).removeprefix('tensor parallel: ')}") from None
        tp = self.tensor_parallel.tp_size
        if tp not in (1, self.size):
            raise ConfigError(f"{path}.tensor_parallel.tp_size: {tp} differs from autotp_size {self.autotp_size}")
