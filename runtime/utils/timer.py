"""`deepspeed.utils.timer`: DeepSpeed's trimmed mean (the comms logger's averages)."""
from ..core.comm.logger import trim_mean

__all__ = ["trim_mean"]
