"""The search space: which configurations a tuning run may try, and each one's config.

A candidate is one point: ZeRO stage, micro-batch size per rank, gradient accumulation
(which keeps the global batch when the user's config fixes train_batch_size), and, when
`fast` is false, CPU offload of the optimizer (stages 1-3) and of the parameters (stage 3).
Everything else in the user's config is kept as it is in every trial's config.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence

from dslaunch.launcher.autotune.config import AutotuningConfig
from dslaunch.launcher.errors import LaunchConfigError

ALL_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True, order=True)
class Candidate:
    stage: int
    micro_batch: int
    grad_accum: int
    offload_optimizer: bool = False
    offload_param: bool = False

    @property
    def name(self) -> str:
        parts = [f"z{self.stage}", f"mbs{self.micro_batch}", f"gas{self.grad_accum}"]
        if self.offload_optimizer:
            parts.append("offopt")
        if self.offload_param:
            parts.append("offparam")
        return "_".join(parts)

    def train_batch(self, dp: int) -> int:
        return self.micro_batch * self.grad_accum * dp

    def ds_config(self, user: Mapping[str, Any], dp: int) -> Dict[str, Any]:
        """The user's config with this candidate's values, without the autotuning section."""
        cfg = copy.deepcopy(dict(user))
        cfg.pop("autotuning", None)
        zero = cfg.get("zero_optimization")
        zero = dict(zero) if isinstance(zero, dict) else {}
        zero["stage"] = self.stage
        for key, on in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            if on:
                zero[key] = {"device": "cpu"}
            else:
                zero.pop(key, None)
        cfg["zero_optimization"] = zero
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.grad_accum
        cfg["train_batch_size"] = self.train_batch(dp)
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


def build_space(user: Mapping[str, Any], at: AutotuningConfig, dp: int) -> List[Candidate]:
    """Every candidate, in grid order (stage, then micro-batch, then offload)."""
    out = []
    for stage in stages_of(user):
        opts = [(False, False)]
        if not at.fast and stage >= 1:
            opts.append((True, False))
            if stage == 3:
                opts.append((True, True))
        for m, g in micro_batches(user, at, dp):
            out.extend(Candidate(stage, m, g, oo, op) for oo, op in opts)
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
