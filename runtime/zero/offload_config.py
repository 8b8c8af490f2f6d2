"""`deepspeed.runtime.zero.offload_config`: DeepSpeed's names for the offload sections."""
from .config import DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig, OffloadDeviceEnum

__all__ = ["OffloadDeviceEnum", "DeepSpeedZeroOffloadOptimizerConfig", "DeepSpeedZeroOffloadParamConfig"]
