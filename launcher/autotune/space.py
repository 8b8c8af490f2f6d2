"""The search space: which configurations a tuning run may try, and each one's config.

A candidate is one point: ZeRO stage, micro-batch size per rank, gradient accumulation
(which keeps the global batch when the user's config fixes train_batch_size), and, when
`fast` is false, CPU offload of the optimizer (stages 1-3) and of the parameters (stage 3).
Everything else in the user's config is kept as it is in every trial's config.

Activation checkpointing on or off is a dimension only when the script has a switch for
it: `arg_mappings.activation_checkpointing` names the script option (a Hugging Face
script's --gradient_checkpointing), given `true` or `false` per trial. A config cannot
switch it: the `activation_checkpointing` section only says how the checkpoints the model
itself makes (deepspeed.checkpointing.checkpoint) are kept.

The tensor-parallel degree (AutoTP training, `tensor_parallel.autotp_size`) is a dimension
when the model allows it: the profile trial asks AutoTP which degrees dividing the ranks it
can split the model at (tp_degrees), and every degree tuned gets its own micro-batch sizes
over its data-parallel size, ranks / tp (the global batch, when fixed, is kept over those).
ZeRO stage 3 is left out with tp above 1: the runtime refuses the pair.

Bucket sizes are tuned, when `fast` is false, after the sweep and only around its best
candidate (bucket_variants), as DeepSpeed's autotuner tunes its per-stage templates
around the best micro-batch: one knob at a time over DeepSpeed's values 5e7, 5e8, 1e9,
the others at the user's (or the runtime's default) value, which bounds the extra trials
to two per knob the stage reads.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from dslaunch.launcher.autotune.config import AutotuningConfig
from dslaunch.launcher.errors import LaunchConfigError

ALL_STAGES = (0, 1, 2, 3)
CHECKPOINTING = "activation_checkpointing"  # the arg_mappings key of the script's on/off option
BUCKET_VALUES = (50_000_000, 500_000_000, 1_000_000_000)  # DeepSpeed's tuning space: 5e7, 5e8, 1e9
# the bucket knobs each stage's runtime reads, with the runtime's defaults (runtime/core/config/zero.py)
BUCKET_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000}
BUCKETS_BY_STAGE = {0: ("reduce_bucket_size",), 1: ("reduce_bucket_size", "allgather_bucket_size"),
                    2: ("reduce_bucket_size", "allgather_bucket_size"),
                    3: ("reduce_bucket_size", "stage3_prefetch_bucket_size")}
_SHORT = {"reduce_bucket_size": "rb", "allgather_bucket_size": "ab", "stage3_prefetch_bucket_size": "pb"}


@dataclass(frozen=True, order=True)
class Candidate:
    stage: int
    micro_batch: int
    grad_accum: int
    offload_optimizer: bool = False
    offload_param: bool = False
    activation_checkpointing: Optional[bool] = None  # None: not tuned, the script does as it does
    buckets: Tuple[Tuple[str, int], ...] = ()  # (zero_optimization key, elements), set by bucket_variants
    tp: int = 1  # tensor_parallel.autotp_size

    @property
    def name(self) -> str:
        parts = [f"z{self.stage}", f"mbs{self.micro_batch}", f"gas{self.grad_accum}"]
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.offload_optimizer:
            parts.append("offopt")
        if self.offload_param:
            parts.append("offparam")
        if self.activation_checkpointing is not None:
            parts.append("ckpt" if self.activation_checkpointing else "nockpt")
        parts.extend(f"{_SHORT[key]}{_sci(value)}" for key, value in self.buckets)
        return "_".join(parts)

    def script_flags(self) -> Dict[str, str]:
        """arg_mappings keys this candidate sets on the script's command line, not in its config."""
        if self.activation_checkpointing is None:
            return {}
        return {CHECKPOINTING: "true" if self.activation_checkpointing else "false"}

    def train_batch(self, dp: int) -> int:
        """The global batch, given the data-parallel size at tp 1 (the ranks' count over tp is this one's)."""
        return self.micro_batch * self.grad_accum * (dp // self.tp)

    def ds_config(self, user: Mapping[str, Any], dp: int) -> Dict[str, Any]:
        """The user's config with this candidate's values, without the autotuning section;
        dp is the data-parallel size at tp 1."""
        cfg = copy.deepcopy(dict(user))
        cfg.pop("autotuning", None)
        if self.tp > 1 or isinstance(cfg.get("tensor_parallel"), dict):
            cfg["tensor_parallel"] = {**(cfg.get("tensor_parallel") or {}), "autotp_size": self.tp}
        zero = cfg.get("zero_optimization")
        zero = dict(zero) if isinstance(zero, dict) else {}
        zero["stage"] = self.stage
        for key, on in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if on:
                zero[key] = {"device": "cpu"}
            else:
                zero.pop(key, None)
        zero.update(self.buckets)
        cfg["zero_optimization"] = zero
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.grad_accum
        # train_batch(dp) samples per step; the runtime, as DeepSpeed 0.19.8, checks the key against
        # every rank (tensor-parallel ones included under AutoTP), which is dp here
        cfg["train_batch_size"] = self.micro_batch * self.grad_accum * dp
        return cfg


def stages_of(user: Mapping[str, Any]) -> List[int]:
    """The stages to tune: zero_optimization.stage when given (an int or a list), else all."""
    zero = user.get("zero_optimization")
    stage = zero.get("stage", "all") if isinstance(zero, dict) else ("all" if zero is None else int(bool(zero)))
    if stage == "all":
        return list(ALL_STAGES)
    stages = stage if isinstance(stage, list) else [stage]
    if not stages or any(s not in ALL_STAGES for s in stages):
        raise LaunchConfigError(f"zero_optimization.stage: {stage!r}: give 0-3, a list of them, or \"all\" to tune")
    return sorted(set(stages))


def tp_degrees(user: Mapping[str, Any], allowed: Sequence[int], why_not: str = "") -> List[int]:
    """The tensor-parallel degrees to tune: `tensor_parallel.autotp_size` when given (a
    number fixes it, a list tunes those), else 1 and every degree the profile trial found
    AutoTP can split the model at (`allowed`; `why_not`: why no other)."""
    section = user.get("tensor_parallel")
    given = section.get("autotp_size") if isinstance(section, dict) else None
    if given is None:
        return sorted({1, *allowed})
    degrees = given if isinstance(given, list) else [given]
    if not degrees or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in degrees):
        raise LaunchConfigError(f"tensor_parallel.autotp_size: {given!r}: give a degree, or a list of them to tune")
    degrees = sorted({max(1, d) for d in degrees})
    if not isinstance(given, list):
        return degrees  # fixed by the user: run as given
    for d in degrees:
        if d > 1 and d not in allowed:
            hint = f": {why_not}" if why_not else f" (it can at {', '.join(map(str, allowed))})" if allowed else ""
            raise LaunchConfigError(f"tensor_parallel.autotp_size: AutoTP cannot split this model at degree {d}{hint}")
    return degrees


def micro_batches(user: Mapping[str, Any], at: AutotuningConfig, dp: int) -> List[tuple]:
    """Every (micro_batch, grad_accum) allowed, smallest micro-batch first.

    With train_batch_size in the user's config the global batch is kept: the micro-batch
    divides the per-rank batch and accumulation makes up the rest. Without it, the user's
    accumulation (default 1) is kept and micro-batches are powers of two bounded by
    max_train_batch_size / max_train_micro_batch_size_per_gpu."""
    lo, hi = at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu
    total = user.get("train_batch_size")
    if isinstance(total, int) and not isinstance(total, bool):
        if total % dp:
            raise LaunchConfigError(f"train_batch_size {total} is not divisible by the {dp} data-parallel ranks")
        per_rank = total // dp
        pairs = [(m, per_rank // m) for m in range(lo, min(hi, per_rank) + 1) if per_rank % m == 0]
    else:
        gas = user.get("gradient_accumulation_steps") or 1
        if at.max_train_batch_size is not None:
            hi = min(hi, at.max_train_batch_size // (gas * dp))
        pairs, m = [], 1
        while m <= hi:
            if m >= lo and m * gas * dp >= at.min_train_batch_size:
                pairs.append((m, gas))
            m *= 2
    if not pairs:
        raise LaunchConfigError("autotuning: no micro-batch size fits the batch limits "
                                f"(micro-batch {lo}-{hi} per rank, {dp} rank(s)); widen max_train_batch_size")
    return pairs


def _sci(n: int) -> str:
    """50000000 -> '5e7' (names of experiments)."""
    exp = len(str(n)) - len(str(n).rstrip("0"))
    return f"{n // 10**exp}e{exp}" if exp else str(n)


def checkpointing_options(at: AutotuningConfig) -> Tuple[Optional[bool], ...]:
    return (False, True) if CHECKPOINTING in at.arg_mappings else (None,)


def build_space(user: Mapping[str, Any], at: AutotuningConfig, dp: int,
                tps: Sequence[int] = (1,)) -> List[Candidate]:
    """Every candidate, in grid order (tp degree, stage, then micro-batch, then offload, then
    checkpointing); dp is the data-parallel size at tp 1."""
    out = []
    for tp in tps:
        if dp % tp:
            raise LaunchConfigError(f"tensor_parallel.autotp_size {tp} does not divide the {dp} data-parallel ranks")
        for stage in stages_of(user):
            if tp > 1 and stage == 3:
                continue  # the runtime refuses ZeRO-3 with AutoTP
            opts = [(False, False)]
            if not at.fast and stage >= 1:
                opts.append((True, False))
                if stage == 3:
                    opts.append((True, True))
            for m, g in micro_batches(user, at, dp // tp):
                out.extend(Candidate(stage, m, g, oo, op, ac, tp=tp) for oo, op in opts
                           for ac in checkpointing_options(at))
    return out


def bucket_variants(best: Candidate, user: Mapping[str, Any]) -> List[Candidate]:
    """The bucket-size candidates around `best`: for each knob its stage reads, each of
    DeepSpeed's values other than the one `best` ran with, the other knobs unchanged."""
    zero = user.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    out = []
    for key in BUCKETS_BY_STAGE[best.stage]:
        current = int(zero.get(key, BUCKET_DEFAULTS[key]))
        for value in BUCKET_VALUES:
            if value != current:
                out.append(replace(best, buckets=((key, value),)))
    return out


def spread(items: Sequence, k: int) -> List:
    """k items spread evenly over `items`, always the first and the last."""
    n = len(items)
    if k >= n:
        return list(items)
    if k == 1:
        return [items[-1]]
    picked = sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in picked]
