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
