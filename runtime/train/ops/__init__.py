"""DeepSpeed's optimizer import paths, backed by dslaunch.kernels.

    dslaunch.runtime.ops.adam.DeepSpeedCPUAdam, .FusedAdam
    dslaunch.runtime.ops.lion.DeepSpeedCPULion, .FusedLion
    dslaunch.runtime.ops.adagrad.DeepSpeedCPUAdagrad
    dslaunch.runtime.ops.lamb.FusedLamb

Each takes DeepSpeed's constructor arguments (positional order included) and is a
torch.optim.Optimizer, so code written for `deepspeed.ops.*` runs unchanged (the Hugging
Face compatibility package exposes these modules as `deepspeed.ops.*`). What DeepSpeed
accepts but this runtime cannot honour is refused with the reason, never ignored.
"""


def _probe_compatible_ops():
    from .op_builder import ALL_OPS

    return {name: builder.is_compatible() for name, builder in ALL_OPS.items()}


def __getattr__(name):
    # `deepspeed.ops.__compatible_ops__`: which ops can run here, asked of the builders
    # (op_builder/) on first access, since asking builds dslaunch's CPU kernels; DeepSpeed
    # probes on first access too. Cached so the one dict persists.
    if name == "__compatible_ops__":
        globals()[name] = _probe_compatible_ops()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
