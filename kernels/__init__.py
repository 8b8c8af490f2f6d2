"""dslaunch.kernels: optimizer kernels (C++ SIMD CPU Adam/Lion/Adagrad, CUDA multi-tensor
Adam) and the optimizers built on them.

Importing this package costs nothing: torch and the compiled ops load on first use of a
name below, so `dslaunch` (which imports the package for `build-ops`) starts in
milliseconds.

    CPUAdam, CPULion, CPUAdagrad   torch.optim.Optimizers stepping fp32 CPU masters through the ops
    cpu_adam_step, cpu_lion_step, cpu_adagrad_step
                                   in-place steps of flat fp32 tensors, bf16/fp16 grads and copy-out
    cpu_adam_available, ...        build/load an op; False means callers fall back to torch
    FusedAdam                      multi-tensor CUDA Adam, device-side step count and inf/NaN skip
    Lion, Lamb                     torch-op optimizers for any device (Lion's maths; DeepSpeed's LAMB)
    fused_cpu_step, describe       the protocol ZeRO offload uses to run an optimizer's fused CPU step
"""
import importlib

_LAZY = {
    "CPUAdam": "cpu_adam",
    "cpu_adam_step": "cpu_adam",
    "cpu_adam_available": "cpu_adam",
    "cpu_adam_info": "cpu_adam",
    "CPULion": "cpu_lion",
    "cpu_lion_step": "cpu_lion",
    "cpu_lion_available": "cpu_lion",
    "CPUAdagrad": "cpu_adagrad",
    "cpu_adagrad_step": "cpu_adagrad",
    "cpu_adagrad_available": "cpu_adagrad",
    "FusedAdam": "fused_adam",
    "fused_adam_available": "fused_adam",
    "Lion": "lion",
    "Lamb": "lamb",
    "FusedCPUStep": "fused_step",
    "FusedStepUnavailable": "fused_step",
    "fused_cpu_step": "fused_step",
    "describe": "fused_step",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
