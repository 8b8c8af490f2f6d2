"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` API (checkpointing.py),
the RNG tracker (rng.py) and where checkpointed inputs wait (saved.py)."""
from . import checkpointing
from .checkpointing import (CheckpointFunction, CudaRNGStatesTracker, checkpoint, configure, get_cuda_rng_tracker,
                            is_configured, model_parallel_cuda_manual_seed, model_parallel_reconfigure_tp_seed, reset)

__all__ = ["checkpointing", "checkpoint", "configure", "is_configured", "reset", "get_cuda_rng_tracker",
           "model_parallel_cuda_manual_seed", "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker",
           "CheckpointFunction"]
