"""`deepspeed.runtime.fp16`: where DeepSpeed's scripts import its loss scalers from."""
from . import loss_scaler

__all__ = ["loss_scaler"]
