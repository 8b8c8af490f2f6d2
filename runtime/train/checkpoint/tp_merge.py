"""Merging one parameter's tensor-parallel slices into its whole tensor by DeepSpeed's
universal-checkpoint rules (deepspeed.checkpoint.ds_to_universal 0.19.8: `merge_tp_slices`,
`_merge_zero_shards`, `_group_per_tp_shapes`, `_validate_autotp_conversion_support`).

DeepSpeed's converter first writes every rank's ZeRO fragments of a parameter to a slice
folder, one file per (tp rank, dp rank, state):

    SLICE_DIR/<param>/<tp>/<state>.<dp:02d>      a flat tensor (the step: its value)

then joins the dp fragments of each tp rank into that rank's slice and the tp slices into the
whole tensor, by the patterns of the checkpoint's universal_checkpoint_info:
replicated (every rank holds it all; the copies must agree), averaged, two sub-parameters
cut along dim 0, fused sub-parameters (each rank holds a piece of each, at the widths
recorded since version 0.4, evenly before), row-parallel (joined along dim 1), anything else
along dim 0; a vocabulary parameter then loses its padding. The result goes to
OUT_DIR/<param>/<state>.pt as {"param": tensor, "cat_dim" | "sub_param_shape" | ...},
the form DeepSpeed's universal loading reads.

Refusals are one line: DeepSpeed asserts these conditions, so they are AssertionErrors too
(UniversalLayoutError), and a layout AutoTP declared unconvertible is a ValueError. A
layer-written affine map (DeepSpeed's newer layout description) is refused: dslaunch's
layers do not write one and this merge does not read one.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ...core.errors import CheckpointError
from ...tensor_parallel.subparams import even_widths
from .constants import (CAT_DIM, PARAM, PARAM_N_SUB_PARAMS, PARAMETER_TO_AVERAGE_PATTERNS,
                        PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0, PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
                        PARAMETER_WITH_SUB_PARAMS, SUB_PARAM_SHAPE, SUB_PARAM_SHARD_WIDTHS,
                        TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_VERSION_KEY, VOCAB_TENSOR,
                        VOCABULARY_PARAMETER_PATTERNS, AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS, ORIGINAL_VOCAB_SIZE)
from .files import load_torch, write_torch
from .foreign import SubparamShape
from ...tensor_parallel.layers import ParamShard
from ...tensor_parallel.shard import vocab_range

AFFINE_MAP = "affine_map"  # DeepSpeed's key of a layer-written layout map in universal_checkpoint_info
MERGED_STATES = ("fp32", "exp_avg", "exp_avg_sq")  # the states DeepSpeed's merge writes


class UniversalLayoutError(CheckpointError, AssertionError):
    """A slice folder or its metadata that cannot be merged (DeepSpeed asserts the same)."""


class UnsupportedAutoTPLayout(CheckpointError, ValueError):
    """An AutoTP layout the layer itself declared unconvertible."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise UniversalLayoutError(message)


def validate_autotp_conversion_support(uc_info: Dict[str, Any]) -> None:
    """Refuse a checkpoint whose AutoTP layers recorded parameters they cannot describe
    (name pattern -> reason); info without that key (older checkpoints) passes."""
    unsupported = uc_info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = ", ".join(f"{p}: {r}" for p, r in sorted(unsupported.items()))
        raise UnsupportedAutoTPLayout(f"AutoTP universal checkpoint conversion is not supported for {details}")


def group_per_tp_shapes(shapes_by_file: Sequence[Dict[str, Any]], pp_degree: int, tp_degree: int
                        ) -> Dict[str, List[Any]]:
    """name -> each tp rank's shape, from the model-states files' param_shapes in their
    pipeline-major order (file i is pipeline stage i // tp, tp rank i % tp). A parameter only
    some stages hold keeps its shapes; one several stages hold (a tied weight) must have the
    same shape in each. A tp rank that never holds the name gets None."""
    _require(len(shapes_by_file) == pp_degree * tp_degree,
             f"{len(shapes_by_file)} model-states files for pipeline {pp_degree} x tensor {tp_degree}")
    per_tp: List[Dict[str, Any]] = []
    for tp in range(tp_degree):
        seen: Dict[str, Any] = {}
        for pp in range(pp_degree):
            for name, shape in shapes_by_file[pp * tp_degree + tp].items():
                _require(name not in seen or seen[name] == shape,
                         f"pipeline replicas of {name} on tp rank {tp} disagree on shape: {seen.get(name)} vs {shape}")
                seen[name] = shape
        per_tp.append(seen)
    names = sorted({n for d in per_tp for n in d})
    return {n: [d.get(n) for d in per_tp] for n in names}


def _dp_files(prefix: str) -> List[str]:
    """The <state>.<dp> files of one tp rank in dp order; a name whose suffix is not a
    number is refused (it would otherwise be silently skipped or misordered)."""
    folder, state = os.path.split(prefix)
    if not os.path.isdir(folder):
        return []
    found = []
    for f in os.listdir(folder):
        if not f.startswith(state + "."):
            continue
        suffix = f[len(state) + 1:]
        if not suffix.isdigit():
            raise UniversalLayoutError(f"cannot parse the dp rank of slice file {os.path.join(folder, f)}")
        found.append((int(suffix), os.path.join(folder, f)))
    return [p for _, p in sorted(found)]


def merge_zero_shards(param_base_path: str, state: str, tp_degree: int,
                      slice_shapes: Optional[Sequence[Any]] = None) -> List[Any]:
    """Each tp rank's slice of `state`: its dp fragments joined (shaped by that rank's
    `slice_shapes` entry when given), or for the step the one value every fragment holds. A
    rank that wrote no fragment holds none of the parameter: with shapes known its slice is
    an empty tensor of its recorded (empty) shape, kept in place so later ranks stay paired
    with their widths; a missing rank whose recorded shape is not empty lost data and is
    refused."""
    slices: List[Any] = []
    missing: List[Tuple[int, int]] = []
    for tp in range(tp_degree):
        paths = _dp_files(os.path.join(param_base_path, str(tp), state))
        if not paths:
            missing.append((tp, len(slices)))
            continue
        shards = [load_torch(p) for p in paths]
        if state == "step":
            _require(all(_same(v, shards[0]) for v in shards),
                     f"{param_base_path}: the dp fragments of tp rank {tp} hold different step values")
            slices.append(shards[0])
            continue
        joined = torch.cat([s.reshape(-1) for s in shards])
        if slice_shapes is not None:
            shape = tuple(slice_shapes[tp])
            _require(math.prod(shape) == joined.numel(),
                     f"{param_base_path}: tp rank {tp}'s {state} fragments hold {joined.numel()} elements, its "
                     f"recorded shape {shape} needs {math.prod(shape)}")
            joined = joined.reshape(shape)
        slices.append(joined)
    if missing and slice_shapes is not None and slices and torch.is_tensor(slices[0]):
        for tp, position in reversed(missing):
            shape = tuple(slice_shapes[tp])
            _require(math.prod(shape) == 0,
                     f"{param_base_path}: no {state} fragment files for tp rank {tp}, whose recorded shape {shape} is "
                     f"not empty")
            slices.insert(position, torch.empty(shape, dtype=slices[0].dtype))
    return slices


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    return a == b


def _resolve_placeholder(shape: List[int], numel: int, name: str) -> List[int]:
    """A view spec's one -1 entry, resolved from the whole parameter's element count."""
    holes = [i for i, d in enumerate(shape) if d is not None and d < 0]
    if not holes:
        return shape
    _require(len(holes) == 1, f"sub-parameter shape {shape} of {name} has {len(holes)} placeholder dimensions")
    known = math.prod(d for i, d in enumerate(shape) if i != holes[0])
    _require(known > 0 and numel % known == 0,
             f"sub-parameter shape {shape} of {name} cannot view a parameter of {numel} elements")
    out = list(shape)
    out[holes[0]] = numel // known
    return out


def _spec(shape: Any) -> tuple:
    return tuple(tuple(d) if isinstance(d, list) else d for d in shape)


def _merge_sub_params(name: str, slices: List[torch.Tensor], sub: SubparamShape, pattern: str,
                      uc_info: Dict[str, Any], tp_degree: int) -> Tuple[torch.Tensor, SubparamShape]:
    """Join each sub-parameter's per-rank pieces, then the sub-parameters in order."""
    dim = sub.partition_dim
    spec = _spec(sub.shape)
    entry = spec[dim]
    version = uc_info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0)
    if version >= 0.4:
        widths_by_pattern = uc_info.get(SUB_PARAM_SHARD_WIDTHS) or {}
        # the widths follow the model's head counts, which the checkpoint does not hold
        _require(pattern in widths_by_pattern,
                 f"universal checkpoint version {version} records no {SUB_PARAM_SHARD_WIDTHS} for {name}, whose "
                 f"pattern {pattern} declares sub-parameters")
        sizes = tuple(entry) if isinstance(entry, tuple) else (entry,)
        widths = [list(w) for w in widths_by_pattern[pattern]]
        normalized = sub
    else:
        if isinstance(entry, tuple):
            sizes, normalized = entry, sub
        else:
            # before 0.4 a number at partition_dim counts equal sub-parameters ((3, -1): q, k, v)
            _require(all(s.dim() > dim for s in slices),
                     f"legacy sub-parameter metadata of {name} needs shaped slices to recover its sizes")
            total = sum(s.shape[dim] for s in slices)
            _require(entry > 0 and total % entry == 0,
                     f"legacy sub-parameter count {entry} of {name} does not divide its dimension {total}")
            sizes = (total // entry,) * entry
            spec = tuple(sizes if i == dim else d for i, d in enumerate(spec))
            normalized = SubparamShape(patterns=sub.patterns, shape=spec, partition_dim=dim)
        widths, uneven = even_widths(sizes, tp_degree)
        _require(widths is not None,
                 f"sub-parameter sizes {uneven} of {name} are not divisible by tp_degree {tp_degree}, and "
                 f"universal checkpoint version {version} predates {SUB_PARAM_SHARD_WIDTHS}, so its "
                 f"uneven split cannot be rebuilt")
    _require(len(widths) == len(sizes), f"{len(widths)} shard-width lists for {len(sizes)} sub-parameters of {name}")
    for size, w in zip(sizes, widths):
        _require(len(w) == tp_degree and sum(w) == size,
                 f"shard widths {w} of {name} do not tile a sub-parameter of {size} over {tp_degree} ranks")
    logical = [sum(d) if isinstance(d, tuple) else d for d in spec]
    logical[dim] = sum(sizes)
    # resolved from the whole parameter: an empty slice cannot infer a -1
    logical = _resolve_placeholder(logical, sum(s.numel() for s in slices), name)
    views = []
    for tp, piece in enumerate(slices):
        shape = list(logical)
        shape[dim] = sum(w[tp] for w in widths)
        _require(math.prod(shape) == piece.numel(),
                 f"tp rank {tp} of {name} holds {piece.numel()} elements, its recorded shard widths describe "
                 f"{tuple(shape)}")
        views.append(piece.reshape(shape))
    offsets = [0] * len(views)
    chunks = []
    for w in widths:
        pieces = []
        for tp, view in enumerate(views):
            pieces.append(view.narrow(dim, offsets[tp], w[tp]))
            offsets[tp] += w[tp]
        chunks.append(torch.cat(pieces, dim=dim))
    return torch.cat(chunks, dim=dim), normalized


def merge_tp_slices(uc_info: Dict[str, Any], out_dir: str, slice_dir: str, tp_degree: int,
                    name_and_shapes: Tuple[str, Optional[Sequence[Any]]]) -> Set[str]:
    """Merge one parameter's slices from `slice_dir` into `out_dir`/<name>/<state>.pt (and
    step.pt); returns the info's patterns this parameter did not match (the caller
    intersects them over all parameters to find patterns that match nothing)."""
    name, per_tp_shapes = name_and_shapes
    if uc_info.get(AFFINE_MAP):
        raise CheckpointError(f"{name}: the checkpoint describes its layout with an affine map, which this merge "
                              "does not read (dslaunch's AutoTP layers do not write one)")
    src, dst = os.path.join(slice_dir, name), os.path.join(out_dir, name)
    replicated = list(uc_info.get(TP_REPLICATED_PARAMETER_PATTERNS) or [])
    averaged = list(uc_info.get(PARAMETER_TO_AVERAGE_PATTERNS) or [])
    row = list(uc_info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS) or [])
    vocab = list(uc_info.get(VOCABULARY_PARAMETER_PATTERNS) or [])
    two_sub = list(uc_info.get(PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0) or [])
    subs = [SubparamShape(**s) for s in uc_info.get(PARAMETER_WITH_SUB_PARAMS) or []]
    unmatched = set(replicated + averaged + row + vocab + two_sub)
    unmatched.update(p for s in subs for p in s.patterns)

    def match(patterns: List[str]) -> Optional[str]:
        hits = [p for p in patterns if re.match(p, name)]
        _require(len(hits) <= 1, f"more than one pattern matches {name}: {hits}")
        if hits:
            unmatched.discard(hits[0])
            return hits[0]
        return None

    sub_hit: Tuple[Optional[SubparamShape], Optional[str]] = (None, None)
    for s in subs:
        p = next((p for p in s.patterns if re.match(p, name)), None)
        if p is not None:
            unmatched.discard(p)
            sub_hit = (s, p)
            break

    os.makedirs(dst, exist_ok=True)
    steps = merge_zero_shards(src, "step", tp_degree, per_tp_shapes)
    if steps:
        write_torch(os.path.join(dst, "step.pt"), steps[0], checksum=False)
    for state in MERGED_STATES:
        slices = merge_zero_shards(src, state, tp_degree, per_tp_shapes)
        if not slices:  # never stepped: ZeRO holds no optimizer state for it
            continue
        record: Dict[str, Any] = {}
        if match(replicated):
            _require(all(torch.equal(slices[0], s) for s in slices[1:]),
                     f"the tp copies of replicated parameter {name} ({state}) differ")
            param = slices[0]
        elif match(averaged):
            param = sum(slices) / len(slices)
        elif match(two_sub):
            halves = [torch.chunk(s, 2, dim=0) for s in slices]
            param = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
            record[CAT_DIM], record[PARAM_N_SUB_PARAMS] = 0, 2
        elif sub_hit[0] is not None:
            param, record[SUB_PARAM_SHAPE] = _merge_sub_params(name, slices, sub_hit[0], sub_hit[1], uc_info,
                                                               tp_degree)
        else:
            record[CAT_DIM] = 1 if match(row) else 0
            param = torch.cat(slices, dim=record[CAT_DIM])
        if match(vocab):
            param = param[:uc_info[ORIGINAL_VOCAB_SIZE], :]  # the padding the vocabulary was cut with
            record[VOCAB_TENSOR] = True
        record[PARAM] = param
        write_torch(os.path.join(dst, f"{state}.pt"), record, deepspeed_objects=True, checksum=False)
    return unmatched


def uc_info_from_shard_specs(specs: Dict[str, Dict[str, Any]], local_shapes: Dict[str, Sequence[int]],
                             tp_degree: int) -> Dict[str, Any]:
    """The universal_checkpoint_info patterns of a dslaunch tensor-parallel checkpoint, which
    records how each split parameter sits in its full one (tensor_slices.shard_specs: split
    dim, full size, fused parts, vocabulary padding) instead of DeepSpeed's patterns. Every
    trained parameter (`local_shapes`: name -> tensor rank 0's shape) gets one `^name$`
    pattern: unsplit ones are replicated, a plain split of dim 0 is joined along it, of dim 1
    of a matrix as row-parallel, fused parts (or another dim) as sub-parameters at the widths
    each rank holds; a vocabulary split is joined along dim 0 as well, its padding rows having
    been left out of the slices (vocab_rows). A split the merge cannot rebuild is refused in
    one line."""
    info: Dict[str, Any] = {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, TP_REPLICATED_PARAMETER_PATTERNS: [],
                            PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [], VOCABULARY_PARAMETER_PATTERNS: [],
                            PARAMETER_WITH_SUB_PARAMS: [], SUB_PARAM_SHARD_WIDTHS: {}}
    for name in sorted(local_shapes):
        pattern, raw = f"^{re.escape(name)}$", specs.get(name)
        if raw is None or raw.get("dim") is None:
            info[TP_REPLICATED_PARAMETER_PATTERNS].append(pattern)
            continue
        spec = ParamShard(dim=raw["dim"], full=raw["full"], parts=tuple(raw.get("parts") or ()),
                          vocab=bool(raw.get("vocab")), conv1d=bool(raw.get("conv1d")),
                          sizes=tuple(raw.get("sizes") or ()),
                          sub_widths=tuple(tuple(w) for w in raw.get("sub_widths") or ()))
        shape = list(local_shapes[name])
        if spec.conv1d:
            # the slices hold the transposed (nn.Linear) layout of an HF Conv1D weight
            raise CheckpointError(f"{name} is an HF Conv1D weight split by tensor parallelism: its slices are stored "
                                  "transposed, which DeepSpeed's universal layout cannot describe")
        _require(0 <= spec.dim < len(shape), f"{name}: split dim {spec.dim} of a {len(shape)}-dim tensor")
        if spec.vocab:
            # the converter writes each rank's real rows only (vocab_rows), so the join is plain
            _require(spec.dim == 0 and not spec.parts, f"{name}: a vocabulary split along dim {spec.dim}")
        elif not spec.parts and not spec.sub_widths and spec.dim == 0:
            pass  # joined along dim 0, each rank at its own recorded shape (an uneven split too)
        elif not spec.parts and not spec.sub_widths and spec.dim == 1 and len(shape) == 2:
            info[PARAMETER_WITH_ROW_PARALLELISM_PATTERNS].append(pattern)
        else:
            sizes = (tuple(sum(w) for w in spec.sub_widths) if spec.sub_widths else tuple(spec.parts or
                                                                                          (spec.full,)))
            per_rank = [spec.ranges(tp_degree, r) for r in range(tp_degree)]
            widths = [[b - a for a, b in (ranks[i] for ranks in per_rank)] for i in range(len(sizes))]
            shape[spec.dim] = sizes
            info[PARAMETER_WITH_SUB_PARAMS].append({"patterns": [pattern], "shape": shape,
                                                    "partition_dim": spec.dim})
            info[SUB_PARAM_SHARD_WIDTHS][pattern] = widths
    return info


def vocab_rows(spec: Dict[str, Any], tp_degree: int, tp_rank: int) -> Optional[int]:
    """How many of a tensor rank's rows of a vocabulary-split parameter are real (the rest
    pad every rank to the same size); None for any other split."""
    if not spec or not spec.get("vocab"):
        return None
    start, stop, _ = vocab_range(spec["full"], tp_degree, tp_rank)
    return stop - start


__all__ = ["MERGED_STATES", "SubparamShape", "UniversalLayoutError", "UnsupportedAutoTPLayout", "group_per_tp_shapes",
           "merge_tp_slices", "merge_zero_shards", "uc_info_from_shard_specs", "vocab_rows",
           "validate_autotp_conversion_support"]
