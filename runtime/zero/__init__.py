"""ZeRO stages 0-3 for dslaunch.runtime, selected by `zero_optimization.stage`.

Importing this package registers the stage strategies with the engine (DataParallelStrategy,
stage 0, in stage0.py; ZeroStage1/2 in stage12.py; ZeroStage3 in stage3.py). The shard
arithmetic (re-cutting saved shards for another world size or stage, consolidation) is
reshard.py's. DeepSpeed's user-facing names live here too:
`zero.Init()` builds a model directly partitioned and `zero.GatheredParameters(params,
modifier_rank=None)` gives temporary full access; `unwrap_model_for_generation(engine)` holds
the whole model gathered, without hooks, for a generation loop.
"""
from dslaunch.compat import paths as _paths

from ..core.errors import CheckpointError
from .reshard import consolidated_state_dict, tied_aliases
from .hook_scope import register_external_parameter, unregister_external_parameter
from .params import GatheredParameters, Init, ZeroParamStatus
from .generation import unwrap_model_for_generation
from .stage0 import DataParallelStrategy
from .stage12 import ZeroStage1, ZeroStage2
from .stage3 import RankDivergenceError, ZeroStage3

__all__ = ["Init", "GatheredParameters", "RankDivergenceError", "CheckpointError", "consolidated_state_dict",
           "tied_aliases", "register_external_parameter", "unregister_external_parameter",
           "DataParallelStrategy", "ZeroStage1", "ZeroStage2", "ZeroStage3", "ZeroParamStatus",
           "unwrap_model_for_generation"]


def __getattr__(name):
    """DeepSpeed's ZeRO paths of the alias table (`deepspeed.runtime.zero.utils`, `.config`, ...)
    as attributes, imported on first use: DeepSpeed's zero package imports them itself."""
    module = _paths.child(__name__, name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return module
