"""`deepspeed.OnDevice(dtype=..., device="meta")`: build a model without allocating its weights.

Inside the context every parameter a module registers is created on `device` (with
`dtype` for floating ones). On the meta device that means no storage at all, so a model far
larger than one rank's memory can be constructed and then filled shard by shard by
`init_inference(model, checkpoint=...)`. Buffers stay real: non-persistent ones (causal
masks, rotary tables) are never in a checkpoint and must keep the values the constructor gave
them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class OnDevice:
    def __init__(self, dtype: Optional[torch.dtype] = None, device="meta", enabled: bool = True):
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved = None

    def __enter__(self):
        if not self.enabled:
            return self
        original = nn.Module.register_parameter
        dtype, device = self.dtype, self.device

        def register_parameter(module, name, param):
            # A parameter already on the device in the dtype is registered as it is:
            # re-wrapping it would untie weights a model shares on purpose (an LM head tied to
            # its embedding). One on the device in another dtype (device="cpu") is cast.
            want = dtype if dtype is not None and param is not None and param.is_floating_point() else None
            if param is not None and (param.device != device or (want is not None and param.dtype != want)):
                data = param.data.to(device=device, dtype=want)
                param = nn.Parameter(data, requires_grad=param.requires_grad)
            original(module, name, param)

        self._saved = original
        nn.Module.register_parameter = register_parameter
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            nn.Module.register_parameter = self._saved
            self._saved = None
        return False
