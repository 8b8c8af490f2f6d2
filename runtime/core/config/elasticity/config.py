"""Elasticity errors (DeepSpeed's names) and reading the `elasticity` section of a dict."""
from __future__ import annotations

from ...strict import ConfigError


class ElasticityError(ConfigError):
    """Base of every elasticity error (one line, exit 2 when uncaught)."""


class ElasticityConfigError(ElasticityError):
    pass


class ElasticityIncompatibleWorldSize(ElasticityError):
    pass


def read_section(ds_config):
    """The parsed `elasticity` section of a DeepSpeed config dict (must be enabled)."""
    from ..parallel import ElasticityConfig
    from ...strict import parse_dataclass

    if not isinstance(ds_config, dict):
        raise ValueError(f"compute_elastic_config: expected the DeepSpeed config as a dict, got "
                         f"{type(ds_config).__name__}")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("elasticity: missing from the config; add it to run an elastic job")
    raw = ds_config["elasticity"]
    if not isinstance(raw, dict):
        raise ElasticityConfigError(f"elasticity: expected an object, got {raw!r}")
    if not raw.get("enabled", False):
        raise ElasticityConfigError("elasticity.enabled: elasticity is disabled; set \"enabled\": true to run an "
                                    "elastic job")
    try:
        return parse_dataclass(ElasticityConfig, raw, "elasticity")
    except ConfigError as exc:
        raise ElasticityConfigError(str(exc)) from None
