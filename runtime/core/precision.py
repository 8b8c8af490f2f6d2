"""Precision in one place: the `PrecisionPolicy` every part of training asks, and what the
engine does to a forward's inputs and context for mixed precision.

`PrecisionPolicy.from_config(config)` is built once by the engine and handed to the strategy
(`StrategyContext.precision`). It says which dtype each kind of tensor has:

  compute          the module's parameters and the forward (fp16.enabled / bf16.enabled, else fp32;
                   torch_autocast keeps fp32 parameters and runs the forward in `autocast`)
  master           ZeRO's master weights (fp32; bf16.bf16_master_weights_and_grads: bf16)
  grad             ZeRO's reduced gradient partitions, where micro-steps accumulate: the compute
                   dtype, DeepSpeed's default gradient_accumulation_dtype (so bf16 and fp16 runs
                   round their sums exactly as DeepSpeed's do), or data_types.grad_accum_dtype
  optimizer_state  what the optimizer keeps its moments in (fp32; bf16.bf16_optimizer_states: bf16;
                   beside bf16/fp16 masters under CPU offload, optimizer.params.fp32_optimizer_states
                   false: the masters' dtype, as DeepSpeed's DeepSpeedCPUAdam then keeps them)
  comm             what gradients are summed in (communication_data_type; None: their own dtype)
  loss_scaler      fp16's one loss scaler (core/loss_scaler.py), or None

A new precision is a new way of filling these fields (and the config check beside them in
config/precision.py), not a branch in the engine or a strategy.

- `fp16.auto_cast`: floating-point tensors among the inputs (nested in lists, tuples and
  dicts) are cast to fp16, as DeepSpeed does.
- `torch_autocast.enabled`: the forward runs under `torch.autocast(dtype=...)`.
- A forward that fails because a float32 input met the model's fp16/bf16 weights is
  reported as one line naming the fix instead of a deep traceback from inside the model.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from .loss_scaler import LossScalerBase, make_loss_scaler
from .strict import ConfigError

_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class PrecisionPolicy:
    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    grad: torch.dtype = torch.float32
    optimizer_state: torch.dtype = torch.float32
    comm: Optional[torch.dtype] = None
    autocast: Optional[torch.dtype] = None
    loss_scaler: Optional[LossScalerBase] = None

    @classmethod
    def from_config(cls, config, compute: Optional[torch.dtype] = None) -> "PrecisionPolicy":
        """The policy of a parsed config (`compute`: the parameters' dtype when a caller other
        than the engine already decided it). The config was checked by config/precision.py."""
        if compute is None:
            compute = torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled \
                else torch.float32
        master = torch.bfloat16 if config.bf16.bf16_master_weights_and_grads else \
            torch.float16 if config.fp16.fp16_master_weights_and_grads else torch.float32
        accum = config.grad_accum_dtype
        if master != torch.float32 and accum is not None and accum != master:
            # DeepSpeed's low-precision masters keep their gradient partitions in the masters' dtype
            raise ConfigError(f"data_types.grad_accum_dtype: {_NAMES[accum]} with {_NAMES[master]} master weights "
                              "and gradients; the gradient partitions are the masters' dtype, remove the key")
        state = torch.bfloat16 if config.bf16.bf16_optimizer_states else torch.float32
        params = config.optimizer.params if config.optimizer is not None else {}
        if (master != torch.float32 and params.get("fp32_optimizer_states") is False
                and config.zero_optimization.offload_optimizer_device != "none"):
            # DeepSpeed 0.19.8 builds DeepSpeedCPUAdam(fp32_optimizer_states=False): moments in the
            # dtype of the masters it steps
            state = master
        ac = config.torch_autocast
        return cls(compute=compute, master=master, grad=accum or compute, optimizer_state=state,
                   comm=config.communication_dtype, autocast=ac.torch_dtype if ac.enabled else None,
                   loss_scaler=make_loss_scaler(config.fp16) if config.fp16.enabled else None)

    @property
    def low_precision_masters(self) -> bool:
        return self.master != torch.float32

    @property
    def sums_in_fp16(self) -> bool:
        """Whether a ZeRO stage's gradient sum can pass fp16's range: the sum runs in fp16 on the
        wire (communication dtype, else the parameters' own) or lands in fp16 partitions. There
        the stages divide by N before the sum, as DeepSpeed's ZeRO 1-2 reduce-scatter and ZeRO-3
        always do, so a loss-scaled step overflows (and is skipped) exactly when DeepSpeed's does."""
        return torch.float16 in (self.comm or self.compute, self.grad)

    def describe(self) -> str:
        """One line for the start-up report: "compute bf16, masters bf16, grads bf16, optimizer state bf16"."""
        parts = [f"compute {_NAMES[self.compute]}"]
        if self.autocast is not None:
            parts[0] += f" (autocast {_NAMES[self.autocast]})"
        parts += [f"masters {_NAMES[self.master]}", f"grads {_NAMES[self.grad]}",
                  f"optimizer state {_NAMES[self.optimizer_state]}"]
        return ", ".join(parts)

    def check_optimizer(self, optimizer, offload: bool, stage: int) -> None:
        """DeepSpeed 0.19.8's requirement on the optimizer that steps low-precision masters:
        under CPU offload (always for fp32 states beside bf16 masters, and for fp16 masters, whose
        states are fp32) it is DeepSpeedCPUAdam, keeping its moments in the dtype the policy says."""
        if not self.low_precision_masters or optimizer is None:
            return
        if not (offload or self.optimizer_state == torch.float32):
            return
        name = type(optimizer).__name__
        key = "bf16.bf16_master_weights_and_grads" if self.master == torch.bfloat16 else \
            "fp16.fp16_master_weights_and_grads"
        if not getattr(optimizer, "low_precision_params", False) or name != "DeepSpeedCPUAdam":
            raise ConfigError(f"{key}: under ZeRO-{stage} CPU offload the optimizer "
                              f"must be DeepSpeedCPUAdam (optimizer type Adam/AdamW builds it), not {name} (as "
                              "DeepSpeed 0.19.8)")
        fp32_states = bool(getattr(optimizer, "fp32_optimizer_states", True))
        if fp32_states != (self.optimizer_state == torch.float32):
            raise ConfigError("bf16.bf16_optimizer_states: true under CPU offload needs DeepSpeedCPUAdam built with "
                              "fp32_optimizer_states=False, so its moments are bf16 (as DeepSpeed 0.19.8)")


class InputDtypeError(ConfigError):
    """A forward input whose dtype does not match the model's compute dtype."""


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [cast_floating(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, cast_floating(v, dtype)) for k, v in value.items())
    return value


def forward_context(policy: PrecisionPolicy, device: torch.device):
    """The forward's autocast, as DeepSpeed's engine sets it: the config's (replacing a
    caller's own autocast) when torch_autocast is enabled; otherwise a caller's autocast on the
    engine's device is switched off inside, since the engine's precision is then the fp16/bf16
    sections' (DeepSpeed 0.19.8 looks at CUDA's autocast only, so on CPU it leaves a caller's on;
    dslaunch asks the engine's device)."""
    if policy.autocast is not None:
        return torch.autocast(device_type=device.type, dtype=policy.autocast)
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def _floats(values: Iterable[Any]):
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                yield v
        elif isinstance(v, (list, tuple)):
            yield from _floats(v)
        elif isinstance(v, dict):
            yield from _floats(v.values())


_DTYPE_WORDS = ("dtype", "Half", "BFloat16", "Float", "scalar type")
_KEYS = {torch.float16: "fp16.enabled", torch.bfloat16: "bf16.enabled"}


def explain_dtype_error(exc: RuntimeError, compute_dtype: torch.dtype, args, kwargs) -> None:
    """Raise InputDtypeError when `exc` comes from float32 inputs meeting 16-bit weights."""
    if compute_dtype not in _KEYS or not any(w in str(exc) for w in _DTYPE_WORDS):
        return
    wrong = sorted({str(t.dtype).replace("torch.", "") for t in _floats(list(args) + list(kwargs.values()))
                    if t.dtype != compute_dtype})
    if not wrong:
        return
    name = str(compute_dtype).replace("torch.", "")
    hint = ' or set "fp16": {"auto_cast": true}' if compute_dtype == torch.float16 else ""
    raise InputDtypeError(
        f"{_KEYS[compute_dtype]}: the model runs in {name} but engine(...) got {', '.join(wrong)} inputs; cast them "
        f"first, e.g. x.to(engine.device, {compute_dtype}){hint} (the model said: {str(exc).splitlines()[0]})"
    ) from None
