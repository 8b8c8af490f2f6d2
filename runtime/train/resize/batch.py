"""The same global batch at every world size of a resizable job. Pure arithmetic.

The batch keys of the config describe the job at its configured size, the world of
--max_nodes hosts ($DSLAUNCH_BASE_WORLD_SIZE): resolved there, they give the global batch
and the micro batch. At any other size the micro batch stays (it is what fits a device) and
the accumulation steps take up the difference: train_batch = micro x accumulation x data
ranks, so accumulation grows as data ranks shrink. A size where the batch does not split
into whole micro batches per data rank cannot run; the launcher learns which sizes can
(world_table) and never plans one that cannot.

With an enabled `elasticity` section its rules decide instead, at every size alike
(deepspeed.elasticity: one batch valid for a list of GPU counts).

Why the same samples follow: with every rank drawing its micro batches from one epoch
permutation in strides of the data-parallel size (dataloader.py), optimizer step s consumes
positions [s x batch, (s+1) x batch) of the permutation at any size, so the mean gradient,
and in fp32 the loss curve, is the same up to the order of the sums.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ...core.config import BatchSizes, DeepSpeedConfig, resolve_batch_sizes
from ...core.config.elasticity.elasticity import engine_batch_sizes
from ...core.strict import ConfigError
from .contract import BASE_WORLD_VAR


def base_data_parallel(base_world: int, world: int, dp: int) -> int:
    """The data-parallel size at the configured world: the model-parallel degree
    (world / dp: pipeline x tensor x sequence) stays as it is."""
    model = world // dp
    if base_world % model:
        raise ConfigError(f"${BASE_WORLD_VAR}={base_world}: not a multiple of the model-parallel degree {model} "
                          f"(world size {world} over {dp} data-parallel rank(s))")
    return base_world // model


def split(cfg: DeepSpeedConfig, dp: int, base_dp: int) -> BatchSizes:
    """The configured global batch (at base_dp data ranks) split over dp data ranks."""
    if cfg.elasticity.enabled:
        return BatchSizes(*engine_batch_sizes(cfg, dp))
    base = resolve_batch_sizes(cfg, base_dp, f"the job's configured size, {base_dp} data-parallel rank(s)")
    batch, micro = base.train_batch_size, base.micro_batch_per_gpu
    if batch % (micro * dp):
        raise ConfigError(f"batch size: the global batch {batch} (configured for {base_dp} data-parallel rank(s)) "
                          f"does not split into micro batches of {micro} over {dp} data-parallel rank(s); "
                          "the launcher should not have planned this size")
    return BatchSizes(batch, micro, batch // (micro * dp))


def batch_sizes(cfg: DeepSpeedConfig, dp: int, dp_source: str, world: int,
                base_world: Optional[int]) -> BatchSizes:
    """What the engine trains with: the config resolved as usual, or in a resizable job
    (base_world given) the configured global batch split over this world's data ranks."""
    if base_world is None:
        return resolve_batch_sizes(cfg, dp, dp_source)
    return split(cfg, dp, base_data_parallel(base_world, world, dp))


def world_table(cfg: DeepSpeedConfig, world: int, dp: int, base_world: int,
                max_world: int) -> Dict[int, Tuple[int, int]]:
    """world size -> (micro batch, accumulation steps) for every world size up to max_world
    the job can run at; reported to the launcher, which plans only these."""
    model = world // dp
    base_dp = base_data_parallel(base_world, world, dp)
    out: Dict[int, Tuple[int, int]] = {}
    for w in range(model, max_world + 1, model):
        try:
            b = split(cfg, w // model, base_dp)
        except ConfigError:
            continue
        out[w] = (b.micro_batch_per_gpu, b.gradient_accumulation_steps)
    return out
