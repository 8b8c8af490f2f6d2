"""How the forward/backward is computed: `activation_checkpointing` and `compile`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..strict import ConfigError, refused, supported
from .checks import positive

DEEPCOMPILE = "DeepCompile is not supported (engine.compile() uses torch.compile); remove it"


@dataclass
class ActivationCheckpointingConfig:
    partition_activations: bool = supported(
        False, "checkpointed inputs are split across the model-parallel group and gathered for recompute")
    cpu_checkpointing: bool = supported(False, "checkpointed inputs wait in host memory (moved back for recompute)")
    contiguous_memory_optimization: bool = supported(
        False, "partitioned checkpoint inputs are packed into one preallocated buffer (needs number_checkpoints)")
    number_checkpoints: Optional[int] = supported(None, "checkpoints per step held in that buffer")
    synchronize_checkpoint_boundary: bool = supported(False, "waits for the GPU at each checkpoint (CUDA only)")
    profile: bool = supported(False, "times each checkpointed function's forward and recompute+backward")

    def validate(self, path: str) -> None:
        positive(path, "number_checkpoints", self.number_checkpoints)
        if self.contiguous_memory_optimization and not self.partition_activations:
            raise ConfigError(f"{path}.contiguous_memory_optimization: needs partition_activations (it packs the "
                              f"partitioned activations)")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ConfigError(f"{path}.number_checkpoints: required with contiguous_memory_optimization")


@dataclass
class CompileConfig:
    """torch.compile settings (DeepSpeed 0.14-0.16 spelling); DeepCompile's keys are refused."""

    enabled: bool = supported(False, "initialize() compiles the module with torch.compile")
    backend: str = supported("inductor", "torch.compile backend (also engine.compile()'s default)")
    kwargs: Dict[str, Any] = supported(factory=dict, note="more torch.compile keyword arguments")
    fullgraph: bool = supported(False, "torch.compile fullgraph")
    dynamic: Optional[bool] = supported(None, "torch.compile dynamic")
    mode: Optional[str] = supported(None, "torch.compile mode")
    options: Optional[Dict[str, Any]] = supported(None, "torch.compile options")
    disable: bool = supported(False, "torch.compile disable (no compilation)")
    deepcompile: Any = refused(DEEPCOMPILE, False)
    autoep_non_moe: Any = refused(DEEPCOMPILE, False)
    free_activation: Any = refused(DEEPCOMPILE, False)
    free_activation_threshold: Any = refused(DEEPCOMPILE, 10 * 1024 * 1024)
    offload_activation: Any = refused(DEEPCOMPILE, False)
    offload_activation_pin_memory: Any = refused(DEEPCOMPILE, True)
    offload_opt_states: Any = refused(DEEPCOMPILE, False)
    double_buffer: Any = refused(DEEPCOMPILE, True)
    symmetric_memory: Any = refused(DEEPCOMPILE, False)
    debug_log: Any = refused(DEEPCOMPILE, False)
    offload_parameters: Any = refused(DEEPCOMPILE, False)
    sync_before_reduce: Any = refused(DEEPCOMPILE, False)
    sync_after_reduce: Any = refused(DEEPCOMPILE, False)
    sync_before_allgather: Any = refused(DEEPCOMPILE, False)
    sync_after_allgather: Any = refused(DEEPCOMPILE, False)
    keep_int_input_tensors: Any = refused(DEEPCOMPILE, True)
    keep_all_input_tensors: Any = refused(DEEPCOMPILE, False)
    passes: Any = refused(DEEPCOMPILE, None, [])

    def torch_compile_kwargs(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic,
                               "disable": self.disable}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options is not None:
            out["options"] = self.options
        out.update(self.kwargs)
        return out
