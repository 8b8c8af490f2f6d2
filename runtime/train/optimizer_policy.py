"""DeepSpeed's two config guards on which optimizer may run under ZeRO.

- `zero_allow_untested_optimizer`: with ZeRO (stage >= 1) an optimizer whose class is not
  among those the ZeRO tests cover is refused unless this key is true.
- `zero_force_ds_cpu_optimizer` (default true): with `offload_optimizer`, a client optimizer
  (passed to initialize) that the offload cannot step with a fused CPU kernel (torch's
  generic loop on the CPU is slow) is refused unless this key is false. As in DeepSpeed, an
  optimizer the config names is never refused here: the config chose it (`torch_adam: true`
  asks for torch's own step on purpose).
"""
from __future__ import annotations

import torch

from ..core.errors import ZeRORuntimeException
from ..core.strict import ConfigError

# Classes the ZeRO tests run (tests/runtime/zero/test_zero_*.py, test_optimizer_types.py); others may add theirs.
ZERO_TESTED_OPTIMIZERS = {"Adam", "AdamW", "CPUAdam", "FusedAdam", "DeepSpeedCPUAdam", "CPULion", "DeepSpeedCPULion",
                          "Lion", "FusedLion", "CPUAdagrad", "DeepSpeedCPUAdagrad", "Adagrad", "MuonWithAuxAdam"}


class UntestedOptimizerError(ConfigError, AssertionError):
    """The refusal DeepSpeed asserts (its tests catch an AssertionError); a ConfigError here too."""


class ForcedCPUOptimizerError(ConfigError, ZeRORuntimeException):
    """The refusal DeepSpeed raises as ZeRORuntimeException; a ConfigError here too."""


def check_optimizer(optimizer: torch.optim.Optimizer, config, client: bool = True) -> None:
    """`client`: the script built the optimizer (initialize(optimizer=...)), not the config."""
    name = type(optimizer).__name__
    zero = config.zero_optimization
    if zero.stage >= 1 and name not in ZERO_TESTED_OPTIMIZERS and not config.zero_allow_untested_optimizer:
        raise UntestedOptimizerError(
            f"zero_allow_untested_optimizer: ZeRO stage {zero.stage} is not tested with {name} "
            f"(tested: {', '.join(sorted(ZERO_TESTED_OPTIMIZERS))}); add "
            f"\"zero_allow_untested_optimizer\": true to use it")
    if client and zero.offload_optimizer_device != "none" and config.zero_force_ds_cpu_optimizer:
        from dslaunch.kernels.fused_step import FusedStepUnavailable, KernelUnavailable, fused_cpu_step

        try:
            fused_cpu_step(optimizer)  # the offload asks the same question (runtime/zero/offload.py)
        except KernelUnavailable:
            pass  # it has a kernel, not built on this machine: the offload falls back and says why
        except FusedStepUnavailable as e:
            raise ForcedCPUOptimizerError(
                f"zero_force_ds_cpu_optimizer: offload_optimizer would step {name} with torch's generic CPU loop "
                f"({e}); use Adam/AdamW/Lion/Adagrad, or set \"zero_force_ds_cpu_optimizer\": false to accept the "
                "slower step") from None
