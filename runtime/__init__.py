"""dslaunch.runtime: the DeepSpeed-compatible training engine (`import dslaunch.runtime as deepspeed`).

    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                                      model_parameters=model.parameters())

Config errors (ConfigError) and checkpoint errors (CheckpointError) that escape a script
are printed as one line on stderr with exit status 2 instead of a traceback.
"""
from __future__ import annotations

import argparse
import os
import sys

from dslaunch.compat import paths as _paths

_paths.install()  # DeepSpeed's module paths (and the runtime's former ones): compat/paths.py

from .core import accelerator  # noqa: E402
from .core.errors import CheckpointError
from .core.comm import init_distributed
from .core.config import DeepSpeedConfig
from .train.engine import DeepSpeedEngine
from .core.loss_scaler import LossScaleStuck
from .core.nonfinite import NonFiniteError
from .core.strategy import GradientStrategy, StrategyContext, register_strategy
from .core.strict import ConfigError
from . import zero  # deepspeed.zero.Init / GatheredParameters; registers stages 0-3
from .inference import InferenceEngine, OnDevice, init_inference
from .train.activation_checkpointing import checkpointing  # deepspeed.checkpointing.configure / checkpoint
from .core.config import elasticity  # deepspeed.elasticity.compute_elastic_config
from . import pipe  # deepspeed.pipe.PipelineModule / LayerSpec / TiedLayerSpec
from .pipe import PipelineModule  # deepspeed.PipelineModule
from .train.pipe_engine import PipelineEngine  # deepspeed.PipelineEngine
from .core.accelerator import get_accelerator  # deepspeed.get_accelerator
from . import tensor_parallel  # deepspeed.runtime.tensor_parallel
from . import sequence  # deepspeed.sequence.layer.DistributedAttention
from .sequence import SequenceParallelError
from .tensor_parallel import set_autotp_mode, tp_model_init  # deepspeed.tp_model_init / set_autotp_mode
from . import utils  # deepspeed.utils.safe_get_full_fp32_param and friends, zero_to_fp32

__version__ = "0.1.0"

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfig",
           "ConfigError", "CheckpointError", "LossScaleStuck", "NonFiniteError", "GradientStrategy",
           "StrategyContext", "register_strategy", "accelerator", "init_inference", "InferenceEngine", "OnDevice",
           "checkpointing", "elasticity", "pipe", "zero", "tensor_parallel", "tp_model_init", "set_autotp_mode",
           "PipelineModule", "PipelineEngine", "get_accelerator", "load_ds_config", "log_dist",
           "sequence", "SequenceParallelError"]



def __getattr__(name):
    """A top-level path of the alias table (`deepspeed.monitor`, `deepspeed.ops`, ...), imported
    on first use as DeepSpeed imports them."""
    module = _paths.top_level(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return module


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               mesh_param=None, config_params=None):
    """Build the engine; returns (engine, optimizer, training_dataloader, lr_scheduler) like DeepSpeed.

    `mpu` is a Megatron-style object (get_model_parallel_rank/world_size/group,
    get_data_parallel_rank/world_size/group) whose groups the engine then uses; a
    `deepspeed.pipe.PipelineModule` brings its own topology and gets a PipelineEngine.
    `mesh_param=(data, sequence)` is DeepSpeed's shorthand for a data x sequence mesh: the
    mesh `sequence_parallel_size` builds (the sequence groups DistributedAttention takes as
    engine.seq_parallel_group; gradients averaged over data x sequence)."""
    _check_mesh_param(mesh_param)
    if dist_init_required is not False and distributed_port is not None:
        init_distributed(distributed_port=distributed_port)
    from .train.pipe_engine import PipelineEngine
    from .pipe.module import PipelineModule

    cls = PipelineEngine if isinstance(model, PipelineModule) else DeepSpeedEngine
    engine = cls(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                 training_data=training_data, lr_scheduler=lr_scheduler, config=config, config_params=config_params,
                 collate_fn=collate_fn, dist_init_required=dist_init_required, mpu=mpu, mesh_param=mesh_param)
    if engine._resize_env.active:
        # --checkpoint_dir / an elastic launch: save every N steps, stop for a resize, and resume
        # now from the latest complete checkpoint (train/resize_driver.py)
        from .train.resize_driver import ResizeDriver

        engine._resize = ResizeDriver(engine, engine._resize_env)
        engine._resize.resume()
    total = getattr(engine.lr_scheduler, "total_num_steps", None)  # WarmupDecayLR, WarmupCosineLR
    if isinstance(total, int) and total > 0:
        engine.set_train_steps(total)  # the run's length for the progress line; the script may still set its own
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _check_mesh_param(mesh_param) -> None:
    if mesh_param is None:
        return
    from .core import comm

    if (not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in mesh_param)):
        raise ConfigError(f"initialize: mesh_param={mesh_param!r}: expected (data_parallel_size, sequence_parallel_size)")
    data, sequence = mesh_param
    world = comm.get_world_size() if comm.is_initialized() else 1
    if data * sequence != world:
        raise ConfigError(f"initialize: mesh_param={tuple(mesh_param)}: {data} x {sequence} is not the world size {world}")


def load_ds_config(config) -> dict:
    """The config as a dict: a dict as given, else the JSON/YAML file at that path (DeepSpeed's
    helper; errors are one line naming the file)."""
    from .core.strict import load_file

    if isinstance(config, dict):
        return config
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        return load_file(str(config))
    raise ConfigError(f"load_ds_config: expected a dict or a path to a JSON/YAML file, got {type(config).__name__}")


def log_dist(message: str, ranks=None, level: int = 20) -> None:
    """Log `message` on the listed ranks only (all ranks for None or [-1]), as DeepSpeed does."""
    import logging

    from .core import comm

    rank = comm.get_rank() if comm.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logging.getLogger("dslaunch.runtime").log(level, f"[Rank {rank}] {message}")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's --deepspeed and --deepspeed_config, their deprecated --deepscale names (as
    DeepSpeed still does), and tolerate --local_rank from older launchers."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (kept for compatibility; the engine is always used)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON (or YAML) config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated name of --deepspeed_config")
    if not any("--local_rank" in a.option_strings for a in parser._actions):
        group.add_argument("--local_rank", type=int, default=-1, help="local rank passed by a launcher")
    return parser


def _one_line_errors(previous):
    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt) and os.environ.get("DSLAUNCH_RUN_ID"):
            # Ctrl-C, passed on to every rank by dslaunch, which says so once: no traceback per
            # rank. Python still runs the exit handlers and ends by SIGINT, as after any Ctrl-C.
            return
        if issubclass(exc_type, (ConfigError, CheckpointError, LossScaleStuck, NonFiniteError, SequenceParallelError)):
            # sys.__stderr__: torch.distributed's own excepthook swaps sys.stderr for a buffer.
            print(f"error: {exc}", file=sys.__stderr__)
            sys.__stderr__.flush()

            os._exit(2)  # skip interpreter teardown (process groups) after a clean message
        previous(exc_type, exc, tb)

    return hook


sys.excepthook = _one_line_errors(sys.excepthook)
