"""dslaunch.runtime: the DeepSpeed-compatible training engine (`import dslaunch.runtime as deepspeed`).

    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                                      model_parameters=model.parameters())

Config errors (ConfigError) and checkpoint errors (CheckpointError) that escape a script
are printed as one line on stderr with exit status 2 instead of a traceback.
"""
from __future__ import annotations

import argparse
import sys

from . import accelerator
from .checkpoint import CheckpointError
from .comm import init_distributed
from .config import DeepSpeedConfig
from .engine import DeepSpeedEngine
from .loss_scaler import LossScaleStuck
from .nonfinite import NonFiniteError
from .strategy import GradientStrategy, StrategyContext, register_strategy
from .strict import ConfigError
from . import zero  # deepspeed.zero.Init / GatheredParameters; registers stages 1-3
from .inference import InferenceEngine, OnDevice, init_inference
from .activation_checkpointing import checkpointing  # deepspeed.checkpointing.configure / checkpoint
from . import elasticity  # deepspeed.elasticity.compute_elastic_config
from . import pipe  # deepspeed.pipe.PipelineModule / LayerSpec / TiedLayerSpec
from . import tensor_parallel  # deepspeed.runtime.tensor_parallel
from . import sequence  # deepspeed.sequence.layer.DistributedAttention
from .sequence import SequenceParallelError
from .tensor_parallel import set_autotp_mode, tp_model_init  # deepspeed.tp_model_init / set_autotp_mode

__version__ = "0.1.0"

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "DeepSpeedConfig",
           "ConfigError", "CheckpointError", "LossScaleStuck", "NonFiniteError", "GradientStrategy",
           "StrategyContext", "register_strategy", "accelerator", "init_inference", "InferenceEngine", "OnDevice",
           "checkpointing", "elasticity", "pipe", "zero", "tensor_parallel", "tp_model_init", "set_autotp_mode",
           "sequence", "SequenceParallelError"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None):
    """Build the engine; returns (engine, optimizer, training_dataloader, lr_scheduler) like DeepSpeed.

    `mpu` is a Megatron-style object (get_model_parallel_rank/world_size/group,
    get_data_parallel_rank/world_size/group) whose groups the engine then uses; a
    `deepspeed.pipe.PipelineModule` brings its own topology and gets a PipelineEngine."""
    if dist_init_required is not False and distributed_port is not None:
        init_distributed(distributed_port=distributed_port)
    from .pipe.engine import PipelineEngine
    from .pipe.module import PipelineModule

    cls = PipelineEngine if isinstance(model, PipelineModule) else DeepSpeedEngine
    engine = cls(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                 training_data=training_data, lr_scheduler=lr_scheduler, config=config, config_params=config_params,
                 collate_fn=collate_fn, dist_init_required=dist_init_required, mpu=mpu)
    total = getattr(engine.lr_scheduler, "total_num_steps", None)  # WarmupDecayLR, WarmupCosineLR
    if isinstance(total, int) and total > 0:
        engine.set_train_steps(total)  # the run's length for the progress line; the script may still set its own
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's --deepspeed and --deepspeed_config (and tolerate --local_rank from older launchers)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (kept for compatibility; the engine is always used)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed JSON (or YAML) config file")
    if not any("--local_rank" in a.option_strings for a in parser._actions):
        group.add_argument("--local_rank", type=int, default=-1, help="local rank passed by a launcher")
    return parser


def _one_line_errors(previous):
    def hook(exc_type, exc, tb):
        if issubclass(exc_type, (ConfigError, CheckpointError, LossScaleStuck, NonFiniteError, SequenceParallelError)):
            import os

            # sys.__stderr__: torch.distributed's own excepthook swaps sys.stderr for a buffer.
            print(f"error: {exc}", file=sys.__stderr__)
            sys.__stderr__.flush()

            os._exit(2)  # skip interpreter teardown (process groups) after a clean message
        previous(exc_type, exc, tb)

    return hook


sys.excepthook = _one_line_errors(sys.excepthook)
