"""DeepSpeed's checkpoint contents <-> dslaunch's in-memory forms. Pure functions, no I/O.

dslaunch writes DeepSpeed's format (so DeepSpeed's load_checkpoint and zero_to_fp32 read
our checkpoints) and reads it (so a DeepSpeed checkpoint resumes here at any world size
and stage). The correspondences:

- ZeRO shard. In memory, a rank's shard lists "pieces" (parameter name, [start, end) in
  its flattened elements, offset in the rank's flat partition) with the fp32 masters and
  optimizer state per piece (reshard.py re-cuts any set of shards). On disk, DeepSpeed
  keeps each rank's flat partition:
    stages 1-2  a param group's trainable parameters end to end, padded to a multiple of
                2 x world size, rank r owning the r-th equal slice; the file holds the fp32
                slice without its padding (single_partition_of_fp32_groups), the optimizer
                state over the padded slice (base_optimizer_state) and the padding
                (group_paddings). Our FlatLayout pads the same way, so the slices coincide.
    stage 3     every parameter cut on its own into world-size chunks of ceil(numel/world);
                a rank's flat (fp32_flat_groups) is its chunk of each parameter in order,
                split into DeepSpeed's sub-groups (sub_group_size).
  The parameter order and shapes come from param_shapes in the model-states file.
- Stage 0. The torch optimizer state_dict; with fp16/bf16 DeepSpeed wraps it with its
  fp32 copies (fp32_groups, per param group in order) and loss-scale fields.
- The rest of the model-states file: DeepSpeed's keys (global_steps, lr_scheduler, ...),
  client_state keys at the top level as DeepSpeed puts them, and dslaunch's own extras
  under "dslaunch" (counters DeepSpeed does not keep, our loss scaler, the client keys).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...core.errors import CheckpointError
from ...core.shard_state import ShardKind
from .foreign import PickledRecord, loss_scaler_record
from .optimizer_state import for_deepspeed_group_state, for_deepspeed_groups, for_deepspeed_torch

# DeepSpeed's files (and our manifest) record the ZeRO stage as a number: this table is the one
# place checkpoint/ turns that number into a shard layout (stages 1 and 2 share one flat format).
_KIND_OF_STAGE = {0: ShardKind.WHOLE, 1: ShardKind.FLAT, 2: ShardKind.FLAT, 3: ShardKind.PER_PARAMETER}


def kind_of_stage(stage: int, where: str = "") -> ShardKind:
    """The shard kind of a saved ZeRO stage number; `where` starts the error line."""
    kind = _KIND_OF_STAGE.get(stage)
    if kind is None:
        raise CheckpointError(f"{where}unknown ZeRO stage {stage}")
    return kind

# Muon's state key: at stages 1-2 DeepSpeed (and dslaunch, on disk) keeps it, in a use_muon group, as
# the whole of every matrix a rank's partition touches (over the partition under CPU offload); read
# that way first (its length can equal the partition's)
MUON_MOMENTUM = "momentum_buffer"
DS_VERSION = "0.19.8"  # the DeepSpeed release whose format we write (its loaders check >= 0.3.17)
SHARD_FORMAT = "dslaunch-zero-shard/1"

# Keys DeepSpeed's model-states file carries besides a script's client_state.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers",
    "dslaunch"})


def _numel(shape) -> int:
    return int(math.prod(int(d) for d in shape))


# -- shapes read from a file ---------------------------------------------------------------------
class ShapeError(CheckpointError):
    """A param_shapes entry no reader may size a buffer from (the caller adds the checkpoint)."""


def shape_problem(shape: Any) -> Optional[str]:
    """Why `shape` (from a checkpoint's param_shapes) is no tensor shape, or None."""
    try:
        dims = tuple(shape)
    except TypeError:
        return "not a list of whole numbers"
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return "not a list of whole numbers"
    if any(d < 0 for d in dims):
        return "a dimension below 0"
    return None


def checked_shapes(raw: Any, capacity: int) -> "OrderedDict[str, Tuple[int, ...]]":
    """One group's param_shapes: names to shapes of whole, non-negative dimensions whose
    elements together fit in `capacity`, the elements the group's flat buffers (all ranks')
    really hold. Every buffer is sized from these shapes, so they are checked before
    anything is allocated: a crafted 2**28 dimension would otherwise allocate gigabytes."""
    try:
        items = list(OrderedDict(raw).items())
    except (TypeError, ValueError):
        raise ShapeError("param_shapes: a group is not a mapping of parameter names to shapes") from None
    out: "OrderedDict[str, Tuple[int, ...]]" = OrderedDict()
    total = 0
    for name, shape in items:
        shown = tuple(shape) if isinstance(shape, (list, tuple)) else shape
        problem = shape_problem(shape)
        if problem:
            raise ShapeError(f"param_shapes: {name} has shape {shown}: {problem}")
        total += _numel(shape)
        if total > capacity:
            raise ShapeError(f"param_shapes: {name} has shape {shown}: the group's parameters up to it need "
                                  f"{total} elements, and its flat buffers hold {capacity}")
        out[str(name)] = tuple(shape)
    return out


# -- flat layouts ------------------------------------------------------------------------------
def stage12_slots(shapes: "OrderedDict[str, Any]", paddings: Optional[Sequence[int]] = None
                  ) -> List[Tuple[str, int, int]]:
    """(name, numel, offset in the group's flat buffer); paddings: DeepSpeed's per-parameter
    alignment padding (parameter_alignment), zeros when absent."""
    out, off = [], 0
    for i, (name, shape) in enumerate(shapes.items()):
        n = _numel(shape)
        out.append((name, n, off))
        off += n + (int(paddings[i]) if paddings else 0)
    return out


def stage12_partition(total: int, world: int) -> int:
    align = 2 * world
    return max(-(-total // align) * align, align) // world


def pieces_in(slots: Sequence[Tuple[str, int, int]], lo: int, hi: int) -> List[Dict[str, Any]]:
    """The pieces of the flat range [lo, hi), offsets relative to lo."""
    out = []
    for name, n, off in slots:
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append({"name": name, "start": a - off, "end": b - off, "offset": a - lo})
    return out


def stage3_slots(shapes: "OrderedDict[str, Any]", world: int) -> List[Tuple[str, int, int, int]]:
    """(name, numel, chunk, offset in a rank's flat) for DeepSpeed's stage-3 flat."""
    out, off = [], 0
    for name, shape in shapes.items():
        n = _numel(shape)
        chunk = -(-n // world)
        out.append((name, n, chunk, off))
        off += chunk
    return out


def stage3_sub_groups(chunks: Sequence[int], sub_group_size: int) -> List[List[int]]:
    """DeepSpeed's split of one param group into sub-groups (stage3._create_fp16_sub_groups):
    indices of consecutive parameters, closed once their partition sizes reach sub_group_size."""
    if not chunks:
        return []
    if sub_group_size is None or sub_group_size >= sum(chunks):
        return [list(range(len(chunks)))]
    groups, cur, size = [], [], 0
    for i, c in enumerate(chunks):
        cur.append(i)
        size += c
        if size >= sub_group_size or i == len(chunks) - 1:
            groups.append(cur)
            cur, size = [], 0
    return groups


# -- writing: our shard -> DeepSpeed's optimizer states -------------------------------------------
def _flat_from_pieces(group: Dict[str, Any], key, size: int) -> torch.Tensor:
    src = group["master"] if key == "master" else group["state"][key]
    # in the dtype the strategy keeps (fp32; bf16 with low-precision masters or states), as DeepSpeed writes it
    dtype = next(iter(src.values())).dtype if src else torch.float32
    flat = torch.zeros(size, dtype=dtype)
    for p in group["pieces"]:
        flat[p["offset"]:p["offset"] + p["end"] - p["start"]] = src[p["name"]].reshape(-1)
    return flat


def _group_state(group: Dict[str, Any], size: int) -> Dict[str, Any]:
    whole = group.get("whole_state", {})
    out = {}
    for k, v in group["state"].items():
        if k in whole:  # stages 1-2, Muon's momentum: the whole of each matrix the partition touches
            out[k] = _whole_flat(whole[k], group["pieces"])
        elif k == "step" and whole:
            continue  # DeepSpeed's Muon group keeps no count (the momentum needs none; the loader adds ours)
        elif isinstance(v, dict):
            out[k] = _flat_from_pieces(group, k, size)
        elif k == "step" and not torch.is_tensor(v):
            out[k] = torch.tensor(float(v), dtype=torch.float32)  # torch's Adam keeps step as a tensor
        else:
            out[k] = v
    return out


def _whole_flat(whole: Dict[str, torch.Tensor], pieces: List[Dict[str, Any]]) -> torch.Tensor:
    """DeepSpeed's stage 1-2 Muon momentum of one rank: the whole tensors of the parameters its
    partition touches, end to end in layout order (no padding)."""
    names = list(dict.fromkeys(p["name"] for p in pieces))
    if not names:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([whole[n].reshape(-1) for n in names])


def _hyper(param_groups: Sequence[Dict[str, Any]], gi: int, params: List[int]) -> Dict[str, Any]:
    g = {k: v for k, v in param_groups[gi].items() if k != "params"} if gi < len(param_groups) else {}
    g["params"] = params
    return g


def zero_optim_states(shard: Dict[str, Any], param_groups: Sequence[Dict[str, Any]], *, clip_grad: float,
                      loss_scaler: PickledRecord, dynamic_loss_scale: bool, sub_group_size: int,
                      ds_class: Optional[str] = None) -> Dict[str, Any]:
    """The optimizer_state_dict DeepSpeed's ZeRO optimizer writes for this rank's shard;
    ds_class: the optimizer DeepSpeed builds for this config (optimizer_state.py), whose
    state form is written."""
    world, rank, stage = int(shard["world_size"]), int(shard["rank"]), int(shard["stage"])
    groups = shard["groups"]
    out: Dict[str, Any] = {"loss_scaler": loss_scaler, "dynamic_loss_scale": dynamic_loss_scale, "overflow": False}
    if kind_of_stage(stage) is ShardKind.FLAT:
        fp32, states, paddings, counts = [], {}, [], []
        for gi, g in enumerate(groups):
            # a group is partitioned over its own axis ("moe" groups: the expert-data-parallel one)
            g_world, g_rank = int(g.get("axis_size", world)), int(g.get("axis_rank", rank))
            counts.append(g_world)
            slots = stage12_slots(OrderedDict(g["shapes"]))
            total = sum(n for _, n, _ in slots)
            size = stage12_partition(total, g_world)
            lo = g_rank * size
            if [dict(p) for p in g["pieces"]] != pieces_in(slots, lo, lo + size):
                raise CheckpointError("internal: this rank's ZeRO partition is not DeepSpeed's; cannot write its format")
            padding = size if total <= lo else max(0, lo + size - total)
            flat = _flat_from_pieces(g, "master", size)
            fp32.append(flat[:size - padding].clone())
            states[gi] = for_deepspeed_group_state(_group_state(g, size), ds_class)
            paddings.append(padding)
        out.update(clip_grad=clip_grad,
                   base_optimizer_state={"state": states, "param_groups": for_deepspeed_groups(
                       [_hyper(param_groups, gi, [gi]) for gi in range(len(groups))], ds_class)},
                   single_partition_of_fp32_groups=fp32, zero_stage=stage, group_paddings=paddings,
                   param_alignment_paddings=[[0] * len(g["shapes"]) for g in groups],
                   partition_count=counts, ds_version=DS_VERSION)
        return out
    flats, states, pg = [], {}, []
    for gi, g in enumerate(groups):
        slots = stage3_slots(OrderedDict(g["shapes"]), world)
        size = sum(c for _, _, c, _ in slots)
        master = _flat_from_pieces(g, "master", size)
        full_state = for_deepspeed_group_state(_group_state(g, size), ds_class)
        ids = []
        for members in stage3_sub_groups([c for _, _, c, _ in slots], sub_group_size):
            a = slots[members[0]][3]
            b = slots[members[-1]][3] + slots[members[-1]][2]
            states[len(flats)] = {k: (v[a:b].clone() if torch.is_tensor(v) and v.numel() == size and v.dim() == 1
                                      else v) for k, v in full_state.items()}
            ids.append(len(flats))
            flats.append(master[a:b].clone())
        pg.append(_hyper(param_groups, gi, ids))
    out.update(zero_stage=3, partition_count=world,
               optimizer_state_dict={"state": states, "param_groups": for_deepspeed_groups(pg, ds_class)},
               fp32_flat_groups=flats)
    return out


def stage3_param_shapes(shard: Dict[str, Any], sub_group_size: int) -> List["OrderedDict[str, torch.Size]"]:
    """param_shapes as DeepSpeed writes it under ZeRO-3: one ordered dict per sub-group."""
    world = int(shard["world_size"])
    out = []
    for g in shard["groups"]:
        shapes = OrderedDict(g["shapes"])
        names = list(shapes)
        slots = stage3_slots(shapes, world)
        for members in stage3_sub_groups([c for _, _, c, _ in slots], sub_group_size):
            out.append(OrderedDict((names[i], torch.Size(shapes[names[i]])) for i in members))
    return out


def stage12_param_shapes(shard: Dict[str, Any]) -> List["OrderedDict[str, torch.Size]"]:
    return [OrderedDict((n, torch.Size(s)) for n, s in g["shapes"].items()) for g in shard["groups"]]


def stage0_optimizer(state: Dict[str, Any], param_groups: Sequence[Dict[str, Any]], mixed: bool,
                     loss_scaler: Optional[Dict[str, Any]], dynamic: Optional[Dict[str, Any]],
                     steps: int, ds_class: Optional[str] = None) -> Dict[str, Any]:
    """Stage 0's entry under "optimizer": the torch state_dict (fp32), or DeepSpeed's
    fp16/bf16 optimizer wrapper with the fp32 copies per param group in order; the state
    in the form of ds_class, the optimizer DeepSpeed builds for this config."""
    optimizer = for_deepspeed_torch(state["optimizer"], ds_class)
    if not mixed:
        return optimizer
    out = {"dynamic_loss_scale": bool(dynamic), "cur_scale": float(loss_scaler["scale"]) if loss_scaler else 1.0,
           "cur_iter": steps, "optimizer_state_dict": optimizer,
           "fp32_groups": [[p.detach().float().clone() for p in g["params"]] for g in param_groups]}
    if dynamic:
        out.update(last_overflow_iter=int(loss_scaler["last_overflow_iter"]), scale_factor=float(dynamic["factor"]),
                   scale_window=int(dynamic["window"]))
    return out


# -- reading: DeepSpeed's optimizer states -> our shard ------------------------------------------
def _partitioned(v: Any, size: int) -> bool:
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() == size


def _is_vector(v: Any) -> bool:
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() > 1


def _is_muon_group(base: Any, gi: int) -> bool:
    """A Muon param group (its hyperparameters say use_muon; SGD's momentum_buffer is partition-shaped)."""
    groups = base.get("param_groups") if isinstance(base, dict) else None
    return isinstance(groups, list) and gi < len(groups) and isinstance(groups[gi], dict) and \
        bool(groups[gi].get("use_muon", False))


def _touched_numel(pieces: List[Dict[str, Any]], shapes) -> int:
    return sum(_numel(shapes[n]) for n in dict.fromkeys(p["name"] for p in pieces))


def _whole_matrices(key: str, v: torch.Tensor, pieces: List[Dict[str, Any]], shapes, gi: int
                    ) -> Dict[str, torch.Tensor]:
    """A stage 1-2 state tensor that holds, end to end, the whole of every parameter the
    rank's partition touches (DeepSpeed's Muon momentum) cut to the partition's pieces."""
    numels = {name: _numel(shape) for name, shape in shapes.items()}
    if v.numel() != sum(numels[p["name"]] for p in pieces):
        raise CheckpointError(f"optimizer state {key!r} of param group {gi} holds {v.numel()} elements: neither "
                              "the rank's partition nor the whole parameters it touches")
    out, at = {}, 0
    for p in pieces:
        out[p["name"]] = v[at + p["start"]:at + p["end"]]
        at += numels[p["name"]]
    return out


def _cut(flat: torch.Tensor, pieces: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    return {p["name"]: flat[p["offset"]:p["offset"] + p["end"] - p["start"]] for p in pieces}


def offloaded(ds_config: Any) -> Optional[bool]:
    """Whether a checkpoint's saved config offloads the optimizer (None: the file does not say)."""
    if not isinstance(ds_config, dict):
        return None
    zero = ds_config.get("zero_optimization")
    off = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return isinstance(off, dict) and off.get("device") in ("cpu", "nvme")


def shard_from_ds(optim: Dict[str, Any], param_shapes: Sequence[Dict[str, Any]], rank: int,
                  offload: Optional[bool] = None) -> Dict[str, Any]:
    """One rank's DeepSpeed optimizer states (the file's "optimizer_state_dict") as our shard.
    offload: whether the saving run offloaded the optimizer (None: not known). At stages 1-2
    DeepSpeed keeps Muon's momentum over whole matrices, but over the partition under CPU
    offload; when the file does not say, a length that fits both is read as whole matrices."""
    try:
        stage = int(optim["zero_stage"])
        kind = _KIND_OF_STAGE.get(stage)
        groups, hyper = [], None
        if kind is ShardKind.FLAT:
            base = optim["base_optimizer_state"]
            if isinstance(base, dict):
                hyper = _hyperparameters(base.get("param_groups"))
            paddings_all = optim.get("param_alignment_paddings")
            world = max(int(w) for w in optim["partition_count"])
            for gi, fp32 in enumerate(optim["single_partition_of_fp32_groups"]):
                size = fp32.numel() + int(optim["group_paddings"][gi])
                shapes = checked_shapes(param_shapes[gi], size * int(optim["partition_count"][gi]))
                slots = stage12_slots(shapes, paddings_all[gi] if paddings_all else None)
                # a "moe" group's partition index is the rank's in its expert-data-parallel group
                # (every ep-th rank): partition_count says how many share the group
                g_rank = rank // (world // int(optim["partition_count"][gi]))
                pieces = pieces_in(slots, g_rank * size, (g_rank + 1) * size)
                gstate = base["state"].get(gi, {}) if isinstance(base, dict) else base[gi]
                muon = _is_muon_group(base, gi) and not offload
                state = {k: (_whole_matrices(k, v, pieces, shapes, gi) if muon and k == MUON_MOMENTUM
                             and _is_vector(v) and v.numel() == _touched_numel(pieces, shapes) else
                             _cut(v, pieces) if _partitioned(v, size) or _partitioned(v, fp32.numel()) else
                             _whole_matrices(k, v, pieces, shapes, gi) if _is_vector(v) else v)
                         for k, v in gstate.items()}
                groups.append({"pieces": pieces, "shapes": {n: list(s) for n, s in shapes.items()},
                               "master": _cut(fp32, pieces), "state": state})
        elif kind is ShardKind.PER_PARAMETER:
            world = int(optim["partition_count"])
            hyper = _hyperparameters(optim["optimizer_state_dict"].get("param_groups"))
            base = optim["optimizer_state_dict"]["state"]
            for i, flat in enumerate(optim["fp32_flat_groups"]):
                shapes = checked_shapes(param_shapes[i], flat.numel() * world)
                pieces = []
                for name, n, chunk, off in stage3_slots(shapes, world):
                    a, b = min(rank * chunk, n), min((rank + 1) * chunk, n)
                    if a < b:
                        pieces.append({"name": name, "start": a, "end": b, "offset": off})
                state = {k: (_cut(v, pieces) if _partitioned(v, flat.numel()) else v)
                         for k, v in base.get(i, {}).items()}
                groups.append({"pieces": pieces, "shapes": {n: list(s) for n, s in shapes.items()},
                               "master": _cut(flat, pieces), "state": state})
        else:
            raise CheckpointError(f"unknown ZeRO stage {stage}")
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"is not a ZeRO optimizer state DeepSpeed or dslaunch wrote ({type(exc).__name__}: "
                              f"{exc})") from None
    out = {"format": SHARD_FORMAT, "stage": stage, "world_size": world, "rank": rank, "groups": groups}
    if hyper is not None:
        out["param_groups"] = hyper  # lr, betas, ...: restored with the state, as torch's load_state_dict does
    return out


def _hyperparameters(param_groups: Any) -> Optional[List[Dict[str, Any]]]:
    """Each param group's hyperparameters, without its parameter indices."""
    if not isinstance(param_groups, list) or not all(isinstance(g, dict) for g in param_groups):
        return None
    return [{k: v for k, v in g.items() if k != "params"} for g in param_groups]


def stage0_from_ds(optimizer: Any, mixed_hint: bool = False) -> Dict[str, Any]:
    """Stage 0's "optimizer" entry as {"optimizer": torch state_dict, "fp32_masters": [...] or
    None (group order)}; also the loss-scale fields of DeepSpeed's fp16 wrapper."""
    if not isinstance(optimizer, dict):
        raise CheckpointError("holds no optimizer state (saved with load_optimizer_states off?)")
    if "optimizer_state_dict" in optimizer:
        masters = [t for group in optimizer.get("fp32_groups", []) for t in group]
        return {"optimizer": optimizer["optimizer_state_dict"], "fp32_masters": masters or None,
                "loss_scale": {"scale": float(optimizer.get("cur_scale", 1.0)),
                               "iteration": int(optimizer.get("cur_iter", 0)),
                               "last_overflow_iter": int(optimizer.get("last_overflow_iter", -1))}}
    if "param_groups" in optimizer:
        return {"optimizer": optimizer, "fp32_masters": None, "loss_scale": None}
    raise CheckpointError("holds an optimizer state this version cannot read")


def loss_scaler_from_ds(record: Any) -> Optional[Dict[str, Any]]:
    """Our loss scaler's state from DeepSpeed's scaler object (dynamic fields when present)."""
    if not isinstance(record, PickledRecord):
        return None
    d = record.__dict__
    return {"scale": float(d.get("cur_scale", 1.0)), "iteration": int(d.get("cur_iter", 0)),
            "last_overflow_iter": int(d.get("last_overflow_iter", -1)),
            "hysteresis_left": int(d.get("cur_hysteresis", 1))}


__all__ = ["DS_KEYS", "DS_VERSION", "kind_of_stage", "loss_scaler_record", "shard_from_ds", "stage0_from_ds",
           "zero_optim_states"]
