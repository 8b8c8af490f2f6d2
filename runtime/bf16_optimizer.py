"""`deepspeed.runtime.bf16_optimizer`: DeepSpeed's bf16 optimizer wrapper (fp32 master weights
under bf16 without ZeRO), named for isinstance checks only (see internals.py): bf16 here is the
engine's precision strategy around the plain torch optimizer, so `isinstance(engine.optimizer,
BF16_Optimizer)` is False."""
from .internals import internal_optimizer

BF16_Optimizer = internal_optimizer(
    "BF16_Optimizer", "bf16 with fp32 master weights is set by \"bf16\": {\"enabled\": true} in the config")

__all__ = ["BF16_Optimizer"]
