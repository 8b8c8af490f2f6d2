"""DeepSpeed's module path for ZeRO-3's parameter names, so `from
deepspeed.runtime.zero.partition_parameters import ZeroParamStatus` (and Init,
GatheredParameters) works as it does with DeepSpeed. The code lives in params.py."""
from .params import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
