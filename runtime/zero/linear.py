"""`deepspeed.runtime.zero.linear`: a linear layer whose backward keeps no gathered weight.

`zero3_linear_wrap(input, weight, bias)` computes input @ weight.T + bias through an autograd
function that saves the weight Parameter itself, not a gathered copy: under ZeRO-3 the saved
weight is released after forward like any other, and backward gathers it again when it finds
it at rest (params.gather / params.release), so a layer's activations do not pin its full
weight between forward and backward. Backward runs under the autocast state forward ran under
(as torch.amp.custom_bwd does), so bf16/fp16 autocast gives the same dtypes both ways.
`LinearModuleForZeroStage3` is nn.Linear computing through it. `autocast_custom_fwd` and
`autocast_custom_bwd` are torch.amp's custom_fwd/custom_bwd bound to the accelerator's device
type, as DeepSpeed's module exports them for scripts' own autograd functions.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import nn

from ..core.accelerator import get_accelerator
from .params import ZeroParamStatus, gather, release


autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=get_accelerator().device_name())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=get_accelerator().device_name())


def _at_rest(weight: torch.Tensor) -> bool:
    return getattr(weight, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE


class LinearFunctionForZeroStage3(torch.autograd.Function):
    generate_vmap_rule = True  # forward is plain torch ops, so torch.func can batch it

    @staticmethod
    def forward(input, weight, bias=None):
        # DeepSpeed's forms: under autocast the product's dtype must survive the bias (a plain
        # `out + bias` would promote a bf16 product back to the fp32 bias's dtype)
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())
        out = input.matmul(weight.t())
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        device = get_accelerator().device_name()
        ctx.autocast_device = device
        ctx.autocast_enabled = torch.is_autocast_enabled(device)
        ctx.autocast_dtype = torch.get_autocast_dtype(device)
        input, weight = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        ctx.save_for_backward(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        regather = _at_rest(weight)
        if regather:
            gather([weight], what="zero3_linear_wrap backward")
        try:
            with torch.autocast(device_type=ctx.autocast_device, enabled=ctx.autocast_enabled,
                                dtype=ctx.autocast_dtype):
                grad_input = grad_weight = grad_bias = None
                if ctx.needs_input_grad[0]:
                    grad_input = grad_output.matmul(weight)
                if ctx.needs_input_grad[1]:
                    if grad_output.dim() == 1:
                        grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
                    else:
                        grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                            input.reshape(-1, input.shape[-1]))
                if bias is not None and ctx.needs_input_grad[2]:
                    grad_bias = grad_output if grad_output.dim() == 1 else grad_output.reshape(
                        -1, grad_output.shape[-1]).sum(0)
            return grad_input, grad_weight, grad_bias
        finally:
            if regather:
                release([weight])


def zero3_linear_wrap(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(nn.Module):
    """nn.Linear's parameters and initialisation, its product through zero3_linear_wrap."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return zero3_linear_wrap(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "zero3_linear_wrap"]
