"""How every stage averages (or sums) gradients over the data-parallel group: the config's
prescale_gradients, gradient_predivide_factor, gradient_allreduce_op and
communication_data_type, in one place.

DeepSpeed's arithmetic, for N data-parallel ranks and predivide factor f:
  default (postscale)   g / f summed over ranks, then multiplied by f / N
  prescale_gradients    g / N summed over ranks
  gradient_allreduce_op "sum": g summed over ranks, divided by nothing
With f = 1 (the default) that is the plain sum divided by N afterwards, which is what
every stage did before these keys existed; the divisions are kept as divisions (not
multiplications by a reciprocal) so the default stays bit-identical to torch DDP's mean.
A predivide factor keeps large sums inside fp16's range; the price is the extra rounding.

plan_buckets groups consecutive tensors into the buckets a reduction sends together (the ZeRO
stages' gradient buckets, MoE's expert parameter groups).

communication_data_type is the dtype the sum runs in (default: the gradients' own, the
model dtype, as DeepSpeed); a bucket is cast to it before the collective and the result
cast back where the stage keeps it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch


@dataclass(frozen=True)
class GradReduction:
    pre_divisor: float = 1.0  # applied to each rank's gradients before the sum
    post_divisor: float = 1.0  # applied to the sum
    dtype: Optional[torch.dtype] = None  # the dtype summed in; None: the buffer's own

    @classmethod
    def from_config(cls, config, world: int, divide_first: bool = False) -> "GradReduction":
        """`divide_first`: each rank's gradients are divided by N before the sum, as DeepSpeed's
        ZeRO 1-2 reduce-scatter and ZeRO-3 do; the ZeRO stages ask for it where the sum runs in
        fp16 or lands in fp16 partitions (PrecisionPolicy.sums_in_fp16)."""
        if config.gradient_allreduce_op == "sum":
            pre, post = 1.0, 1.0  # the plain sum (the config refuses prescaling and a predivide factor with it)
        elif config.prescale_gradients:
            pre, post = float(world), 1.0
        elif divide_first and config.gradient_predivide_factor == 1.0:
            # in fp16 the order decides whether a loss-scaled sum overflows (and the step is
            # skipped), so fp16 sums take DeepSpeed's order; elsewhere dividing after keeps
            # DDP's bits
            pre, post = float(world), 1.0
        else:
            f = float(config.gradient_predivide_factor)
            pre, post = f, world / f
        return cls(pre, post, config.communication_dtype)

    def outgoing(self, t: torch.Tensor) -> torch.Tensor:
        """What to hand the collective for `t`: `t` itself (divided in place) when no cast is
        asked for, else a divided copy in the communication dtype."""
        if self.dtype is not None and self.dtype != t.dtype:
            t = t.to(self.dtype)
        if self.pre_divisor != 1.0:
            t.div_(self.pre_divisor)
        return t

    def finish_(self, t: torch.Tensor) -> torch.Tensor:
        """The summed gradients `t` divided the rest of the way to the mean (in place)."""
        if self.post_divisor != 1.0:
            t.div_(self.post_divisor)
        return t


def plan_buckets(sizes: Sequence[int], bucket_numel: int) -> List[List[int]]:
    """Group consecutive item indices into buckets of at most bucket_numel elements; an
    item larger than the bucket gets a bucket of its own. Order is preserved because
    ranks must issue collectives in the same order."""
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    buckets: List[List[int]] = []
    cur: List[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if cur and filled + n > bucket_numel:
            buckets.append(cur)
            cur, filled = [], 0
        cur.append(i)
        filled += n
    if cur:
        buckets.append(cur)
    return buckets
