"""Elastic training's batch arithmetic, as `deepspeed.elasticity`: compute_elastic_config,
and the engine's use of the `elasticity` section (batch sizes that fit the world size)."""
from . import config
from .config import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize
from .elasticity import compute_elastic_config, elastic_batch, highly_composite_numbers

__all__ = ["compute_elastic_config", "elastic_batch", "ElasticityError", "ElasticityConfigError",
           "ElasticityIncompatibleWorldSize", "highly_composite_numbers", "config"]
