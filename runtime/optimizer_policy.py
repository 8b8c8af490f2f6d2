"""DeepSpeed's two config guards on which optimizer may run under ZeRO.

- `zero_allow_untested_optimizer`: with ZeRO (stage >= 1) an optimizer whose class is not
  among those the ZeRO tests cover is refused unless this key is true.
- `zero_force_ds_cpu_optimizer` (default true): with `offload_optimizer`, an optimizer
  that the offload cannot step with a fused CPU kernel (torch's generic loop on the CPU is
  slow) is refused unless this key is false.
"""
from __future__ import annotations

import torch

from .strict import ConfigError

# Classes the ZeRO parity tests run (tests/test_zero_*.py); other packages may add theirs.
ZERO_TESTED_OPTIMIZERS = {"Adam", "AdamW", "CPUAdam", "FusedAdam"}
# Classes the offload steps with dslaunch.kernels' fused CPU op (see runtime/zero/offload.py).
FUSED_CPU_OPTIMIZERS = {"Adam", "AdamW", "CPUAdam"}


def check_optimizer(optimizer: torch.optim.Optimizer, config) -> None:
    name = type(optimizer).__name__
    zero = config.zero
    if zero.stage >= 1 and name not in ZERO_TESTED_OPTIMIZERS and not config.zero_allow_untested_optimizer:
        raise ConfigError(f"zero_allow_untested_optimizer: ZeRO stage {zero.stage} is not tested with {name} "
                          f"(tested: {', '.join(sorted(ZERO_TESTED_OPTIMIZERS))}); add "
                          f"\"zero_allow_untested_optimizer\": true to use it")
    if zero.offload_optimizer_device != "none" and config.zero_force_ds_cpu_optimizer:
        fused = name in FUSED_CPU_OPTIMIZERS and not any(g.get("amsgrad") for g in optimizer.param_groups)
        if not fused:
            raise ConfigError(f"zero_force_ds_cpu_optimizer: offload_optimizer would step {name} with torch's generic "
                              f"CPU loop (no fused CPU kernel for it); use Adam/AdamW, or set "
                              f"\"zero_force_ds_cpu_optimizer\": false to accept the slower step")
