"""DeepSpeed's elastic batch sizes: one global batch that many world sizes can train with
unchanged convergence (micro batch x accumulation x data-parallel size always equals it).

Version 0.1 works in GPUs: candidate batches are each acceptable micro batch (and their
least common multiple) scaled by the largest highly composite number that keeps them
within max_train_batch_size; the candidate compatible with the most GPU counts in
[min_gpus, max_gpus] wins (ties: the larger batch, or the smaller with
prefer_larger_batch false). Version 0.2 works in nodes of num_gpus_per_node GPUs with
model parallelism, and for a world size outside the list picks the largest batch that
fits it.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache, reduce
from typing import List, Optional, Sequence, Tuple

from .config import ElasticityConfigError, ElasticityError, ElasticityIncompatibleWorldSize, read_section

LATEST_VERSION = 0.2
MINIMUM_DEEPSPEED_VERSION = "0.3.8"
HCN_LIMIT = 720720  # highly composite numbers up to here cover batch sizes of 720K


@lru_cache(maxsize=1)
def highly_composite_numbers(limit: int = HCN_LIMIT) -> Tuple[int, ...]:
    """Numbers with more divisors than every smaller number (OEIS A002182), up to limit.
    Every one is 2^a 3^b 5^c ... with non-increasing exponents, so only those are tried."""
    primes = (2, 3, 5, 7, 11, 13, 17)
    found = []

    def walk(i: int, value: int, max_exp: int, divisors: int) -> None:
        found.append((value, divisors))
        if i == len(primes):
            return
        v = value
        for e in range(1, max_exp + 1):
            v *= primes[i]
            if v > limit:
                break
            walk(i + 1, v, e, divisors * (e + 1))

    walk(0, 1, 64, 1)
    out, best = [], 0
    for value, divisors in sorted(found):
        if divisors > best:
            out.append(value)
            best = divisors
    return tuple(out)


def _scale(base: int, cap: int) -> int:
    """base times the largest highly composite number that keeps it within cap."""
    hcn = [h for h in highly_composite_numbers() if h * base <= cap]
    return base * hcn[-1]


def candidate_batch_sizes(bases: Sequence[int], max_batch: int) -> List[int]:
    return sorted({base if base == max_batch else _scale(base, max_batch) for base in bases if base <= max_batch})


def valid_gpu_counts(batch: int, micro_batches: Sequence[int], min_gpus: int, max_gpus: int) -> List[int]:
    """GPU counts that split `batch` into whole micro batches of an acceptable size."""
    valid = set()
    for mb in micro_batches:
        if batch % mb:
            continue
        most = batch // mb
        for n in [most] + list(range(1, most // 2 + 1)):
            if min_gpus <= n <= max_gpus and most % n == 0:
                valid.add(n)
    return sorted(valid)


def _best(candidates, micro_batches, min_gpus, max_gpus, prefer_larger) -> Tuple[int, List[int]]:
    best_batch, best_valid = int(min(micro_batches)), []
    for batch in candidates:
        valid = valid_gpu_counts(batch, micro_batches, min_gpus, max_gpus)
        more = len(valid) > len(best_valid)
        tie = len(valid) == len(best_valid) and (batch > best_batch if prefer_larger else batch < best_batch)
        if more or tie:
            best_batch, best_valid = batch, valid
    return best_batch, best_valid


def gpus_v01(micro_batches, max_batch, min_gpus=None, max_gpus=None, prefer_larger=True) -> Tuple[int, List[int]]:
    min_gpus = min_gpus or 1
    max_gpus = max_gpus or max_batch // min(micro_batches)
    if any(mb > max_batch for mb in micro_batches):
        raise ElasticityConfigError(f"elasticity.micro_batch_sizes: every micro batch must be <= max_train_batch_size "
                                    f"{max_batch}, got {list(micro_batches)}")
    lcm = reduce(lambda a, b: a * b // math.gcd(a, b), micro_batches)
    candidates = candidate_batch_sizes(list(micro_batches) + [lcm], max_batch)
    return _best(candidates, micro_batches, min_gpus, max_gpus, prefer_larger)


def _micro_for(batch: int, dp: int, micro_batches, prefer_larger: bool) -> Optional[int]:
    fits = [mb for mb in micro_batches if batch // dp % mb == 0]
    if not fits:
        return None
    return max(fits) if prefer_larger else fits[0]


def gpus_v02(micro_batches, max_batch, current_gpus, min_gpus, max_gpus, prefer_larger, gpus_per_node, mp_size):
    if gpus_per_node % mp_size:
        raise ElasticityError(f"elasticity.num_gpus_per_node: {gpus_per_node} is not divisible by "
                              f"model_parallel_size {mp_size} (version 0.2)")
    dp_per_node = gpus_per_node // mp_size
    batch, nodes = gpus_v01(micro_batches, int(max_batch / dp_per_node), int(min_gpus / gpus_per_node),
                            int(max_gpus / gpus_per_node), prefer_larger)
    batch *= dp_per_node
    valid_dp = [n * dp_per_node for n in nodes]
    if current_gpus // mp_size in valid_dp:
        return batch, valid_dp, _micro_for(batch, current_gpus // mp_size, micro_batches, prefer_larger)
    dp = (current_gpus / gpus_per_node) * dp_per_node
    fitting = [math.floor(max_batch / float(mb * dp)) * mb * dp for mb in micro_batches]
    batch = max(fitting) if prefer_larger else min(fitting)
    return batch, [int(dp)], _micro_for(batch, int(dp), micro_batches, prefer_larger)


def _version_tuple(v: str) -> Tuple[int, ...]:
    parts = []
    for p in str(v).split("."):
        digits = "".join(ch for ch in p if ch.isdecimal())
        parts.append(int(digits or 0))
    return tuple(parts)


def _world_from_env(version) -> int:
    value = os.environ.get("WORLD_SIZE")
    if value is None or not value.isnumeric():
        raise ElasticityConfigError(f"elasticity: version {version} needs the world size: pass world_size= to "
                                    f"compute_elastic_config or set WORLD_SIZE (it is {value!r})")
    return int(value)


def _largest_micro(batch: int, world: int, micro_batches) -> int:
    for mb in sorted(set(micro_batches), reverse=True):
        if batch // world % mb == 0:
            return mb
    raise ElasticityError(f"elasticity: no micro batch in {list(micro_batches)} divides the batch {batch} over "
                          f"{world} ranks")


def elastic_batch(section, world_size: int = 0, return_microbatch: bool = False):
    """compute_elastic_config on an already parsed `elasticity` section."""
    version = float(section.version)
    if section.model_parallel_size > 1 and version != 0.2:
        raise ElasticityConfigError(f"elasticity.model_parallel_size: version {section.version} does not support "
                                    f"model parallelism (use version 0.2)")
    if version > LATEST_VERSION:
        raise ElasticityConfigError(f"elasticity.version: {section.version} is newer than the latest supported, "
                                    f"{LATEST_VERSION}")
    micro = section.micro_batch_sizes
    if version == 0.1:
        batch, valid = gpus_v01(micro, section.max_train_batch_size, section.min_gpus, section.max_gpus,
                                section.prefer_larger_batch)
        candidate = None
    else:
        current = world_size if world_size != 0 else _world_from_env(section.version)
        batch, valid, candidate = gpus_v02(micro, section.max_train_batch_size, current, section.min_gpus,
                                           section.max_gpus, section.prefer_larger_batch, section.num_gpus_per_node,
                                           section.model_parallel_size)
    batch = int(batch)
    if world_size <= 0 and return_microbatch and version == 0.2:
        return batch, valid, candidate
    if world_size <= 0 and return_microbatch:
        world_size = _world_from_env(section.version)
    if world_size > 0:
        if world_size not in valid:
            raise ElasticityIncompatibleWorldSize(f"elasticity: world size {world_size} is not one of the valid "
                                                  f"GPU counts {valid}")
        return batch, valid, _largest_micro(batch, world_size, micro)
    return batch, valid


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
                           return_microbatch: bool = False):
    """DeepSpeed's API: (final_batch_size, valid_gpus) or, given a world size (or
    return_microbatch), (final_batch_size, valid_gpus, micro_batch_size)."""
    section = read_section(ds_config)
    if _version_tuple(target_deepspeed_version) < _version_tuple(MINIMUM_DEEPSPEED_VERSION):
        raise ElasticityError(f"elasticity: target DeepSpeed version {target_deepspeed_version} is older than "
                              f"{MINIMUM_DEEPSPEED_VERSION}, the first with elasticity")
    return elastic_batch(section, world_size, return_microbatch)


def check_scheduler_config(section) -> None:
    """The resource scheduler's copy (DEEPSPEED_ELASTICITY_CONFIG) must match what the job runs with."""
    import json

    raw = os.environ.get("DEEPSPEED_ELASTICITY_CONFIG")
    if raw is None:
        return
    data = json.loads(raw)
    theirs = read_section(data if "elasticity" in data else {"elasticity": data})
    for key in ("max_train_batch_size", "micro_batch_sizes", "version"):
        if getattr(theirs, key) != getattr(section, key):
            raise ElasticityConfigError(f"elasticity.{key}: the job has {getattr(section, key)} but the resource "
                                        f"scheduler (DEEPSPEED_ELASTICITY_CONFIG) has {getattr(theirs, key)}")


def engine_batch_sizes(cfg, world_size: int) -> Tuple[int, int, int]:
    """(train_batch_size, micro batch, accumulation steps) that the elastic section sets for
    this data-parallel world size, as DeepSpeed's engine sets them."""
    section = cfg.elasticity
    check_scheduler_config(section)
    batch, _, micro = elastic_batch(section, world_size=world_size)
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
             if getattr(cfg, k) is not None]
    if given and not section.ignore_non_elastic_batch_info:
        raise ElasticityConfigError(f"elasticity: {', '.join(given)} would be overridden by the elastic batch sizes; "
                                    f"remove them, or set \"ignore_non_elastic_batch_info\": true")
    return batch, micro, batch // (micro * world_size)
