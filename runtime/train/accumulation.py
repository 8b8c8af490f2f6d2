"""Who owns the gradient-accumulation boundary: the engine (DeepSpeed's default,
`managed_gradient_accumulation: true`) or the script (`false`, DeepSpeed 0.19's unmanaged mode).

Managed: the engine counts micro-steps and the step at every gradient_accumulation_steps-th
micro-step is the one that reduces, clips and updates; `set_gradient_accumulation_boundary`
may override the count (Accelerate, the HF Trainer).

Unmanaged: every backward only accumulates (nothing waits for a boundary that the micro-step
count would give), and every `step()` is the boundary: it reduces what the backwards since
the last step left, and updates. The number of backwards between steps may vary; the loss is
still divided by gradient_accumulation_steps unless the script passes scale_wrt_gas=False,
and global_samples grows by the micro-batches actually seen, as in DeepSpeed.

This module holds the pure part: which combinations DeepSpeed refuses, and the samples a
step counts. The engine holds the state.
"""
from __future__ import annotations

from ..core.config import DeepSpeedConfig
from ..core.strict import ConfigError


class AccumulationConfigError(ConfigError, AssertionError):
    """A combination DeepSpeed refuses with an assertion at initialize: a ConfigError (one
    line, exit 2 when uncaught) that is also an AssertionError, the type its tests expect."""


def check_accumulation_mode(config: DeepSpeedConfig, pipeline: bool) -> None:
    """Refuse, as DeepSpeed 0.19.8 does, what unmanaged accumulation cannot serve."""
    if config.managed_gradient_accumulation:
        return
    z = config.zero_optimization
    # Stages 0 and 1 reduce once, at the step, in unmanaged mode; an explicit overlap_comm asks
    # for reduction during backward, which only the partitioned-gradient stages do per backward.
    if z.stage < 2 and z.overlap_comm is True:
        raise AccumulationConfigError(
            f"managed_gradient_accumulation=False supports ZeRO overlap_comm only with ZeRO stage 2 or 3 (stage "
            f"{z.stage} reduces once, at step()); remove zero_optimization.overlap_comm or set it to false")
    if pipeline:
        raise AccumulationConfigError(
            "managed_gradient_accumulation=False is not supported with pipeline parallelism: the pipeline engine's "
            "train_batch() owns the accumulation boundary")


def samples_in_step(config_train_batch: int, accumulation_steps: int, managed: bool, backwards: int) -> int:
    """What one optimizer step adds to global_samples: the configured global batch when the
    engine owns the boundary, else the micro-batches the script actually ran (times the
    data-parallel ranks, which train_batch / accumulation_steps already counts)."""
    if managed:
        return config_train_batch
    return config_train_batch // accumulation_steps * backwards
