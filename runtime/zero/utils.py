"""`deepspeed.runtime.zero.utils`: ZeRORuntimeException, the class DeepSpeed's ZeRO refusals
are raised as. dslaunch's ZeRO refusals that DeepSpeed raises as this class (a client
optimizer under offload_optimizer with zero_force_ds_cpu_optimizer) are ConfigErrors that are
also ZeRORuntimeExceptions, so code catching either catches them."""


class ZeRORuntimeException(Exception):
    pass


__all__ = ["ZeRORuntimeException"]
