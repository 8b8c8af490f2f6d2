"""dslaunch.kernels: fused optimizer kernels (C++ SIMD CPU Adam, CUDA multi-tensor Adam).

Importing this package costs nothing: torch and the compiled ops load on first use of a
name below, so `dslaunch` (which imports the package for `build-ops`) starts in
milliseconds.

    CPUAdam               torch.optim.Optimizer over fp32 CPU parameters (AdamW-compatible state)
    cpu_adam_step         in-place step of flat fp32 tensors, bf16/fp16 grads and copy-out
    cpu_adam_available    build/load the CPU op; False means callers fall back to torch
    FusedAdam             multi-tensor CUDA Adam, device-side step count and inf/NaN skip
"""
import importlib

_LAZY = {
    "CPUAdam": "cpu_adam",
    "cpu_adam_step": "cpu_adam",
    "cpu_adam_available": "cpu_adam",
    "cpu_adam_info": "cpu_adam",
    "FusedAdam": "fused_adam",
    "fused_adam_available": "fused_adam",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
