"""The memory model: bytes one rank needs for a candidate, before anything is launched.

Model states follow the ZeRO paper's accounting, per rank with data-parallel size N and
P parameters: parameters and gradients in the model dtype (2 bytes in fp16/bf16, else 4),
optimizer state K bytes per parameter (Adam's two fp32 moments: 8; plus a 4-byte fp32
master copy in fp16/bf16). Stage 1 divides the optimizer state by N, stage 2 the
gradients too, stage 3 the parameters too. CPU offload moves the optimizer state (and at
stage 3 the parameters) to host memory: off the device, though on a CPU-only machine the
host *is* the device, so nothing is saved there. Activations are measured, not guessed:
the bytes autograd saved for backward in one profiled micro-batch, scaled by the
micro-batch size.

Tensor parallelism (AutoTP, degree t) splits the parameters of the layers it shards: the
profile trial reports how many parameters AutoTP would split (S of P), so a rank holds
P - S + S / t of them, and its ZeRO partitions run over the ranks / t data-parallel ranks.
The activations are those measured at tp 1, an upper bound (column outputs are split too).

Activation checkpointing is modelled from the same profile step (activation_model):
the profile measures what the forward saved outside checkpointed segments (F), the
inputs each checkpointed segment kept (K), and, in backward, what each segment's
recompute saved (s_1..s_n). With checkpointing on, a rank holds F + K and one segment's
recompute at a time: F + K + max(s). With it off, every segment keeps its own
activations from the forward to its backward: F + sum(s). The profile trial runs with
checkpointing on when it is tuned, so both are measured in one launch; predicted
against measured bytes is reported for every trial either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher.autotune.space import Candidate

# optimizer state bytes per parameter, by the config's optimizer type (lower case)
STATE_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "deepspeedcpuadam": 8, "lamb": 8,
               "fusedlamb": 8, "lion": 4, "cpulion": 4, "fusedlion": 4, "adagrad": 4, "cpuadagrad": 4,
               "sgd": 4, "rmsprop": 4}
DEFAULT_STATE_BYTES = 8  # no optimizer section (the script brings one): assume Adam, the common case


@dataclass(frozen=True)
class ModelInfo:
    """What the profile trial measured."""

    params: int  # parameters of the whole model
    activation_bytes_per_sample: float  # saved for backward, per sample of a micro-batch
    dp: int  # data-parallel ranks
    memory_limit: int  # bytes one rank may use (device free memory, or the host's share)
    on_cpu: bool  # no accelerator: offloading saves nothing
    # per sample, with and without activation checkpointing (activation_model); None: not tuned
    checkpointed_bytes_per_sample: Optional[float] = None
    plain_bytes_per_sample: Optional[float] = None
    # AutoTP: degree -> parameters it splits at that degree (the others stay whole on every rank)
    tp_split_params: Mapping[int, int] = field(default_factory=dict)
    tp_refusal: str = ""  # why AutoTP cannot split the model, when it cannot

    def activations(self, c: Candidate) -> float:
        """Activation bytes per sample of the micro-batch for candidate c."""
        if c.activation_checkpointing is None or self.checkpointed_bytes_per_sample is None:
            return self.activation_bytes_per_sample
        return self.checkpointed_bytes_per_sample if c.activation_checkpointing else self.plain_bytes_per_sample


def activation_model(forward_saved: float, kept_inputs: float, segments: Sequence[float]) -> Tuple[float, float]:
    """(with checkpointing, without) activation bytes from one profiled step with it on:
    forward_saved outside the segments, kept_inputs of the segments, and what each
    segment's recompute saved (all per sample)."""
    if not segments:  # the script made no checkpoint: the switch changes nothing measurable
        return forward_saved + kept_inputs, forward_saved + kept_inputs
    return forward_saved + kept_inputs + max(segments), forward_saved + sum(segments)


@dataclass(frozen=True)
class Precision:
    model_bytes: int  # bytes per parameter and gradient
    master_bytes: int  # fp32 master copy kept by the optimizer in fp16/bf16
    state_bytes: int

    @classmethod
    def of(cls, user: Mapping[str, Any]) -> "Precision":
        half = any(isinstance(user.get(k), dict) and user[k].get("enabled") for k in ("fp16", "bf16", "bfloat16"))
        opt = user.get("optimizer")
        kind = str(opt.get("type", "")).lower() if isinstance(opt, dict) else ""
        return cls(2 if half else 4, 4 if half else 0, STATE_BYTES.get(kind, DEFAULT_STATE_BYTES))


def predict_bytes(c: Candidate, info: ModelInfo, prec: Precision) -> int:
    """Bytes on one rank's device for candidate c."""
    n = info.dp // c.tp
    split = info.tp_split_params.get(c.tp, 0) if c.tp > 1 else 0
    p = info.params - split + split / c.tp
    params = prec.model_bytes * p / (n if c.stage >= 3 else 1)
    grads = prec.model_bytes * p / (n if c.stage >= 2 else 1)
    optim = (prec.master_bytes + prec.state_bytes) * p / (n if c.stage >= 1 else 1)
    if not info.on_cpu:
        if c.offload_optimizer:
            optim = 0
        if c.offload_param:
            params = 0
    activations = info.activations(c) * c.micro_batch
    return int(params + grads + optim + activations)


def mib(n: float) -> str:
    """Bytes for people: 36.0 KiB, 812.5 MiB, 2.00 GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB"


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str) -> int:
    """'300MiB', '2GB', '1048576' -> bytes; anything else is a usage error."""
    import re

    from dslaunch.launcher.errors import LaunchConfigError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise LaunchConfigError(f"--autotuning_memory_limit {text}: give a size such as 512MiB, 2GB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
