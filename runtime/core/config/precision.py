"""Precision sections: `fp16`, `bf16`, `torch_autocast`, `data_types`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from ..strict import ConfigError, refused, supported
from .checks import positive, within

# DeepSpeed's spellings (its DtypeEnum) of the dtypes a gradient may be accumulated in.
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "float": "float32", "torch.float32": "float32",
               "fp16": "float16", "float16": "float16", "half": "float16", "torch.float16": "float16",
               "bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16"}


KEEP_IN_FP32_AUTO = "auto"
_SHORT = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}


def dtype_named(path: str, value: str, names=DTYPE_NAMES):
    """The torch dtype a config spells `value`; a ConfigError naming the key otherwise."""
    import torch

    key = str(value).lower()
    if key not in names:
        raise ConfigError(f"{path}: unknown dtype {value!r}; use one of {', '.join(sorted(set(names)))}")
    return getattr(torch, names[key])


FP32_MIN_POWER, FP32_MAX_POWER = -126, 127  # 2**power is a normal fp32 number
FP32_MAX = 3.4028234663852886e38


@dataclass
class FP16Config:
    enabled: bool = supported(False, "fp16 compute with fp32 master weights and dynamic or static loss scaling")
    auto_cast: bool = supported(False, "floating-point tensors passed to engine(...) are cast to fp16")
    loss_scale: float = supported(0.0, "0 = dynamic loss scaling, otherwise this static scale")
    initial_scale_power: int = supported(16, "the dynamic scale starts at 2**initial_scale_power")
    loss_scale_window: int = supported(1000, "clean steps before the dynamic scale doubles")
    hysteresis: int = supported(2, "overflows tolerated before the scale halves")
    consecutive_hysteresis: bool = supported(False, "a clean step refills the hysteresis")
    min_loss_scale: float = supported(1.0, "the dynamic scale never drops below this (a clear error when stuck)")
    fp16_master_weights_and_grads: bool = supported(
        False, "ZeRO 1-3 under CPU offload with DeepSpeedCPUAdam (as DeepSpeed) keep master weights and gradient "
               "partitions in fp16, moments fp32 (fp16 with optimizer.params.fp32_optimizer_states false), under fp16's "
               "loss scaler; refused at stage 0, without offload and "
               "with torch_autocast float16 (docs/zero.md, low-precision master states)")

    def validate(self, path: str) -> None:
        positive(path, "loss_scale", self.loss_scale, allow_zero=True)
        positive(path, "hysteresis", self.hysteresis)
        # a scale multiplies an fp32 loss: beyond fp32's range every step would overflow
        # (and 2.0 ** a large power is an OverflowError)
        within(path, "initial_scale_power", self.initial_scale_power, FP32_MIN_POWER, FP32_MAX_POWER)
        within(path, "loss_scale", self.loss_scale, 0, FP32_MAX)
        # The dynamic scaler's window and floor are read only while it runs (fp16 on, loss_scale
        # 0); with a static scale or fp16 off DeepSpeed 0.19.8 accepts any value there, and so
        # does this (their types are still checked by the parser).
        if self.dynamic_scaling():
            positive(path, "loss_scale_window", self.loss_scale_window)
            positive(path, "min_loss_scale", self.min_loss_scale)
            within(path, "min_loss_scale", self.min_loss_scale, 0, FP32_MAX)

    def dynamic_scaling(self) -> bool:
        """Whether the dynamic loss scaler runs: fp16 on and no static loss_scale."""
        return bool(self.enabled) and self.loss_scale == 0


@dataclass
class BF16Config:
    enabled: bool = supported(False, "bf16 compute with fp32 master weights")
    immediate_grad_update: bool = supported(
        False, "read where DeepSpeed reads it, ZeRO stage 1 with bf16 and data_types.grad_accum_dtype fp32: "
               "each parameter's bf16 gradient is added into its fp32 sum in its accumulation hook and freed, "
               "which this engine's stage 1 always does there (false, DeepSpeed adds at the end of backward: "
               "the same sums, measured equal); elsewhere refused, as DeepSpeed never reads it")
    check_grad_overflow: bool = supported(
        True, "an inf/nan gradient norm skips the step (counted as skipped), at every ZeRO stage (DeepSpeed: "
              "stages 1-2 only); false applies it, as DeepSpeed. Written without nonfinite_check, it gives "
              "DeepSpeed's answer: the nonfinite_check guard stays off")
    bf16_master_weights_and_grads: bool = supported(
        False, "ZeRO 1-3 keep master weights and gradient partitions in bf16; see check_master_states")
    bf16_optimizer_states: bool = supported(
        False, "with bf16_master_weights_and_grads: optimizer state (Adam's moments) in bf16")


@dataclass
class NonFiniteCheckConfig:
    """dslaunch's own (DeepSpeed applies NaN updates in fp32/bf16): see runtime/core/nonfinite.py."""

    enabled: bool = supported(True, "fp32/bf16: a NaN/inf global gradient norm skips the step and the progress "
                                    "line says so at once; it takes the norm at every step, whatever compute_grad_norm says "
                                    "(false: DeepSpeed's behaviour). Off unless this section is written when "
                                    "the config writes bf16.check_grad_overflow")
    max_consecutive_steps: int = supported(3, "training stops with one line naming the steps after this many "
                                              "non-finite steps in a row")

    def validate(self, path: str) -> None:
        positive(path, "max_consecutive_steps", self.max_consecutive_steps)


_BF16_NAMES = ("bfloat16", "bf16", "torch.bfloat16")


@dataclass
class TorchAutocastConfig:
    enabled: bool = supported(False, "the forward runs under torch.autocast (parameters stay fp32)")
    dtype: Literal["bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", "half", "torch.float16"] = supported(
        "bfloat16", "torch.autocast's lower precision dtype (str(torch.bfloat16) too, as DeepSpeed)")
    lower_precision_safe_modules: Any = refused(
        "reducing chosen modules' gradients in the autocast dtype is not supported; gradients are reduced in "
        "fp32", None)

    @property
    def torch_dtype_name(self) -> str:
        return "bfloat16" if self.dtype in _BF16_NAMES else "float16"

    @property
    def torch_dtype(self):
        import torch

        return torch.bfloat16 if self.dtype in _BF16_NAMES else torch.float16


@dataclass
class DataTypesConfig:
    grad_accum_dtype: Optional[str] = supported(
        None, "dtype gradients are accumulated in (fp32, bf16, fp16): stage 0 full gradients (the model dtype "
              "only), stage 1 micro-batch sums (param.grad_accum, when not the model dtype), the reduced "
              "partitions of stages 1-3; unset: the model dtype for both, as DeepSpeed 0.19.8 (bf16 sums "
              "round as DeepSpeed's do)")
    param_dtype: Optional[str] = supported(
        None, "a check, as DeepSpeed's: it must name the dtype fp16/bf16 trains the parameters in (fp32 when "
              "neither), else initialize raises an AssertionError naming both")
    buffer_dtype: Optional[str] = supported(
        None, "under fp16/bf16, the dtype floating buffers are cast to; unset, buffers keep the dtype they "
              "came in (a rotary inv_freq stays fp32), as DeepSpeed 0.19.8")
    keep_in_fp32_modules: Any = supported(
        KEEP_IN_FP32_AUTO, "buffers kept in (or brought back to) fp32 under fp16/bf16, by name: \"auto\" "
                           "the model's transformers lists (_keep_in_fp32_modules_strict, and under fp16 "
                           "_keep_in_fp32_modules), a list of patterns (* is any characters, matched "
                           "anywhere in the buffer's full name), [] none")

    def validate(self, path: str) -> None:
        prefix = f"{path}." if path else ""
        for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
            if getattr(self, key) is not None:
                dtype_named(prefix + key, getattr(self, key))
        keep = self.keep_in_fp32_modules
        if keep is None:
            self.keep_in_fp32_modules = KEEP_IN_FP32_AUTO
        elif keep != KEEP_IN_FP32_AUTO and not (isinstance(keep, list) and all(isinstance(n, str) for n in keep)):
            raise ConfigError(f"{prefix}keep_in_fp32_modules: must be \"auto\" or a list of name patterns, "
                              f"got {keep!r}")


class ParamDtypeError(ConfigError, AssertionError):
    """data_types.param_dtype naming another dtype than the one the parameters train in; also
    an AssertionError, the type DeepSpeed raises."""


def training_dtype(fp16: bool, bf16: bool):
    """The dtype fp16/bf16 puts the parameters in (fp32 when neither is enabled)."""
    import torch

    return torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32


def check_param_dtype(param_dtype: Optional[str], fp16: bool, bf16: bool) -> None:
    """DeepSpeed's rule: data_types.param_dtype, when set, is the dtype fp16/bf16 already gives;
    the masters, reductions and loss scaling all follow those flags, so another would be unsafe."""
    if param_dtype is None:
        return
    requested, model = dtype_named("data_types.param_dtype", param_dtype), training_dtype(fp16, bf16)
    if requested != model:
        raise ParamDtypeError(
            f"data_types.param_dtype: {param_dtype!r} conflicts with the enabled precision "
            f"({_SHORT[str(model)]}); set the matching fp16/bf16 \"enabled\" flag or remove the key")


def check_precision(fp16: FP16Config, bf16: BF16Config, autocast: TorchAutocastConfig) -> None:
    if fp16.enabled and bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled: choose one of fp16 and bf16")
    if autocast.enabled and (fp16.enabled or bf16.enabled):
        raise ConfigError("torch_autocast.enabled: cannot be combined with fp16 or bf16 (autocast keeps fp32 "
                          "parameters); choose one")


def check_master_states(fp16: FP16Config, bf16: BF16Config, stage: int, offload_device: str,
                        autocast: Optional[TorchAutocastConfig] = None) -> None:
    """The low-precision master-state combinations DeepSpeed 0.19.8 allows (its config check and
    its ZeRO optimizers' `_configure_master_weights`), each refusal one line with its reason.
    The optimizer's own requirement (DeepSpeedCPUAdam under offload) is checked where the
    optimizer is known: PrecisionPolicy.check_optimizer."""
    f16, b16, states = fp16.fp16_master_weights_and_grads, bf16.bf16_master_weights_and_grads, \
        bf16.bf16_optimizer_states
    if not (f16 or b16 or states):
        return
    if f16 and b16:
        raise ConfigError("fp16.fp16_master_weights_and_grads and bf16.bf16_master_weights_and_grads: mutually "
                          "exclusive; choose one")
    key = ("fp16.fp16_master_weights_and_grads" if f16 else "bf16.bf16_master_weights_and_grads" if b16
           else "bf16.bf16_optimizer_states")
    if stage not in (1, 2, 3):
        raise ConfigError(f"{key}: only supported with ZeRO stage 1, 2 or 3 (zero_optimization.stage is {stage})")
    if states and not b16:
        raise ConfigError("bf16.bf16_optimizer_states: requires bf16.bf16_master_weights_and_grads (the optimizer "
                          "state follows the masters)")
    if offload_device == "nvme":
        raise ConfigError(f"{key}: with zero_optimization.offload_optimizer.device nvme is not supported; use "
                          "\"cpu\" (DeepSpeed's low-precision masters are a CPU-offload feature)")
    if f16 and offload_device != "cpu":
        raise ConfigError("fp16.fp16_master_weights_and_grads: requires zero_optimization.offload_optimizer.device "
                          "\"cpu\" with DeepSpeedCPUAdam (as DeepSpeed 0.19.8)")
    if f16 and autocast is not None and autocast.enabled and autocast.torch_dtype_name == "float16":
        # DeepSpeed 0.19.8 passes its checks, then steps through torch's GradScaler, which stops at
        # the first step on the fp16 gradient partitions
        raise ConfigError("fp16.fp16_master_weights_and_grads: with torch_autocast dtype float16 is not supported: "
                          "DeepSpeed 0.19.8 steps it through torch's GradScaler, which fails at the first step "
                          "(\"Attempting to unscale FP16 gradients\"); use torch_autocast dtype bfloat16 or fp16.enabled")
    if b16 and not states and offload_device != "cpu":
        raise ConfigError("bf16.bf16_master_weights_and_grads: fp32 optimizer states beside bf16 masters need "
                          "zero_optimization.offload_optimizer.device \"cpu\" with DeepSpeedCPUAdam (as DeepSpeed "
                          "0.19.8); or set bf16.bf16_optimizer_states true")
