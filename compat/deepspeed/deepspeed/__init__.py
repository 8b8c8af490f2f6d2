"""`deepspeed`: DeepSpeed's Python API, served by dslaunch.runtime.

This is dslaunch's opt-in compatibility package, not DeepSpeed. Code that imports
`deepspeed` (the Hugging Face Trainer, Accelerate, user scripts) gets dslaunch's engine,
ZeRO stages, optimizers and launcher under DeepSpeed's names.

Module layout: a few modules live here because DeepSpeed keeps names where dslaunch has no
module of that name (deepspeed.utils, deepspeed.checkpoint.utils, deepspeed.launcher.runner).
Every other `deepspeed.X.Y` is dslaunch.runtime.X.Y itself (the same module object, so
`deepspeed.runtime.engine.DeepSpeedEngine is dslaunch.runtime.engine.DeepSpeedEngine`); see
_aliases.py.
"""
try:
    import dslaunch.runtime as _runtime
except ModuleNotFoundError as _exc:  # pragma: no cover - exercised only without dslaunch
    if _exc.name not in ("dslaunch", "dslaunch.runtime"):
        raise
    raise ModuleNotFoundError("deepspeed (dslaunch's compatibility package) needs dslaunch installed in this "
                              "environment: pip install dslaunch, or reinstall it from its repository") from None

from . import _aliases

_aliases.install()

from dslaunch.runtime import (  # noqa: E402
    CheckpointError, ConfigError, DeepSpeedConfig, DeepSpeedEngine, add_config_arguments, init_distributed,
    initialize, set_autotp_mode, tp_model_init,
)

from . import accelerator, comm, runtime, utils, zero  # noqa: E402,F401  (aliases of dslaunch.runtime.*)
from .version import __version__  # noqa: E402

_base = __version__.split("+")[0].split(".")
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in _base[:3])
__git_hash__ = None
__git_branch__ = None

# DeepSpeed's error for a bad config; dslaunch raises ConfigError, which callers catch as this.
DeepSpeedConfigError = ConfigError


def __getattr__(name):
    """Any other public name of dslaunch.runtime (init_inference, PipelineModule, ...), else a
    submodule imported on first use (`deepspeed.ops`, `deepspeed.checkpoint`, as in DeepSpeed,
    where importing them pulls in optional pieces)."""
    import importlib

    if name.startswith("_"):
        raise AttributeError(name)
    if hasattr(_runtime, name):
        return getattr(_runtime, name)
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}") from None


__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfig",
           "DeepSpeedConfigError", "CheckpointError", "ConfigError", "tp_model_init", "set_autotp_mode", "zero",
           "comm", "ops", "accelerator", "runtime", "utils", "__version__"]
