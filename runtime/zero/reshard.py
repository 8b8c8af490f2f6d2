"""Reading ZeRO shards back: any saved world size and stage into any current one.

The shard arithmetic of the ZeRO stages: the stages call it to resume (assemble,
shards_from_stage0, whole_optimizer_state) and checkpoint/ calls it to write, consolidate
and convert files; it knows nothing of files or of the engine.

A shard (ZeroStage1/2.partition_state / the stage-3 equivalent) holds, per param
group, the pieces this rank owned as {"name", "start", "end"} in the parameter's
flattened coordinates, the full shape of every parameter, and tensors keyed by
parameter name: "master" (fp32 weights) and, under "state", each optimizer state tensor
that is partitioned like the weights. Scalars (Adam's step) are stored as they are.
Pieces are looked up by name across all groups, so regrouping between runs is harmless.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch

from ..core.errors import CheckpointError
from .partition import coverage_gaps as _gaps
from .partition import pieces_from_dict as _pieces

Key = Union[str, Tuple[str, str]]


def _tensors(group: Dict[str, Any], key: Key) -> Dict[str, torch.Tensor]:
    if key == "master":
        return group["master"]
    return group["state"].get(key[1], {})


def _index(shards: Sequence[Dict[str, Any]], key: Key) -> Dict[str, List[Tuple[int, int, torch.Tensor]]]:
    idx: Dict[str, List[Tuple[int, int, torch.Tensor]]] = {}
    for sh in shards:
        for g in sh["groups"]:
            tens = _tensors(g, key)
            if not isinstance(tens, dict):
                continue
            for p in _pieces(g["pieces"]):
                if p.name in tens:
                    t = tens[p.name]
                    if not torch.is_tensor(t) or t.numel() != p.end - p.start:
                        # a damaged or mismatched file: its slot table and its tensors disagree
                        got = f"{t.numel()} elements" if torch.is_tensor(t) else type(t).__name__
                        raise CheckpointError(f"checkpoint is damaged: the saved piece [{p.start}, {p.end}) of "
                                              f"{_keyname(key)} {p.name!r} holds {got}")
                    idx.setdefault(p.name, []).append((p.start, p.end, t))
    return idx


def assemble(shards: Sequence[Dict[str, Any]], gi: int, key: Key,
             want: Iterable[Tuple[str, int, int, int]], out: torch.Tensor) -> None:
    """out[offset:offset+(end-start)] <- elements [start, end) of each wanted parameter,
    taken from whichever saved pieces overlap them, in any saved group (`gi`, the
    caller's group, only labels errors). A wanted element no shard holds is
    an error (a missing rank file, or a checkpoint of a different model)."""
    idx = _index(shards, key)
    for name, start, end, offset in want:
        got = idx.get(name)
        if got is None:
            raise CheckpointError(f"checkpoint has no {_keyname(key)} for parameter {name!r} (param group {gi})")
        spans = []
        for a, b, t in got:
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out[offset + lo - start:offset + hi - start].copy_(t[lo - a:hi - a])
                spans.append((lo - start, hi - start))
        gaps = _gaps(spans, end - start)
        if gaps:
            s, e = gaps[0]
            raise CheckpointError(f"checkpoint is missing elements [{start + s}, {start + e}) of {_keyname(key)} "
                                  f"{name!r} (a rank's shard file is absent?)")


def _keyname(key: Key) -> str:
    return "fp32 weights" if key == "master" else f"optimizer state {key[1]!r}"


def full_fp32_params(shards: Sequence[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """Every partitioned parameter, whole, in fp32, shaped as recorded."""
    shapes: Dict[str, List[int]] = {}
    for sh in shards:
        for g in sh["groups"]:
            shapes.update(g["shapes"])
    out = {}
    for name, shape in shapes.items():
        numel = 1
        for d in shape:
            numel *= d
        t = torch.zeros(numel, dtype=torch.float32)
        assemble(shards, 0, "master", [(name, 0, numel, 0)], t)
        out[name] = t.view(shape)
    return out


def consolidated_state_dict(shards: Sequence[Dict[str, Any]], module_state: Dict[str, torch.Tensor] = None,
                            aliases: Dict[str, str] = None) -> Dict[str, torch.Tensor]:
    """A single fp32 state_dict: trainable parameters from the fp32 shards; frozen
    parameters and buffers from the module state saved beside them (floating ones cast
    to fp32); tied names (alias -> canonical) filled from their canonical parameter."""
    params = full_fp32_params(shards)
    out: Dict[str, torch.Tensor] = {}
    for k, v in (module_state or {}).items():
        if k in params:
            continue
        out[k] = v.detach().float().clone() if torch.is_floating_point(v) else v.detach().clone()
    out.update(params)
    for alias, canon in (aliases or {}).items():
        if canon in out:
            out[alias] = out[canon]
    if module_state:
        order = list(module_state.keys()) + [k for k in out if k not in module_state]
        out = {k: out[k] for k in order if k in out}
    return out


def tied_aliases(module: torch.nn.Module) -> Dict[str, str]:
    """state_dict name -> the name its tied parameter is stored under (its first name)."""
    first: Dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def shards_from_stage0(state: Dict[str, Any], group_names: Sequence[Sequence[str]],
                       module_state: Dict[str, torch.Tensor]) -> List[Dict[str, Any]]:
    """A stage-0 checkpoint's optimizer state (a torch optimizer state_dict, plus fp32
    masters in mixed precision) as one shard holding every parameter whole, so a ZeRO
    stage can resume from it. Parameters are matched by position within each group."""
    opt = state.get("optimizer") if isinstance(state, dict) else None
    if not isinstance(opt, dict) or "param_groups" not in opt:
        raise CheckpointError("checkpoint optimizer state is neither a ZeRO shard nor a torch optimizer state_dict")
    pgs = opt["param_groups"]
    if [len(pg["params"]) for pg in pgs] != [len(n) for n in group_names]:
        raise CheckpointError(f"stage-0 optimizer state has param groups of sizes {[len(pg['params']) for pg in pgs]}, "
                              f"this model's are {[len(n) for n in group_names]}")
    masters = state.get("fp32_masters")
    flat_names = state.get("master_names") or [n for names in group_names for n in names]  # the masters' own order
    if masters is not None and len(masters) != len(flat_names):
        masters = None
    by_name = dict(zip(flat_names, masters)) if masters is not None else {}
    groups = []
    for pg, names in zip(pgs, group_names):
        g = {"pieces": [], "shapes": {}, "master": {}, "state": {}}
        for idx, name in zip(pg["params"], names):
            full = by_name.get(name, module_state[name])
            numel = full.numel()
            g["pieces"].append({"name": name, "start": 0, "end": numel, "offset": 0})
            g["shapes"][name] = list(full.shape)
            g["master"][name] = full.detach().reshape(-1).float()
            for k, v in opt["state"].get(idx, {}).items():
                if torch.is_tensor(v) and v.numel() == numel and k != "step":
                    g["state"].setdefault(k, {})[name] = v.reshape(-1).float()
                else:
                    g["state"][k] = v
        groups.append(g)
    return [{"format": "dslaunch-zero-shard/1", "stage": 0, "world_size": 1, "rank": 0, "groups": groups,
             "param_groups": [{k: v for k, v in pg.items() if k != "params"} for pg in pgs]}]


def whole_optimizer_state(shards: Sequence[Dict[str, Any]], numels: Dict[str, int]
                          ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, Any]]]:
    """The inverse of shards_from_stage0, for resuming ZeRO shards (any stage and saved
    world size) under stage 0: each named parameter's fp32 weights and optimizer state,
    whole and flat. A partitioned state tensor is re-cut from every shard holding pieces
    of it; a scalar (Adam's step) is taken from the saved group that held the parameter.
    A parameter the shards keep no state for (never stepped) gets an empty state."""
    tensor_keys: Dict[str, set] = {}
    scalars: Dict[str, Dict[str, Any]] = {}
    for sh in shards:
        for g in sh["groups"]:
            names = {p.name for p in _pieces(g["pieces"])}
            for k, v in g["state"].items():
                for n in names:
                    if isinstance(v, dict):
                        if n in v:
                            tensor_keys.setdefault(n, set()).add(k)
                    else:
                        scalars.setdefault(n, {})[k] = v
    masters, states = {}, {}
    for name, numel in numels.items():
        masters[name] = torch.zeros(numel, dtype=torch.float32)
        assemble(shards, 0, "master", [(name, 0, numel, 0)], masters[name])
        st: Dict[str, Any] = {}
        for k in sorted(tensor_keys.get(name, ())):
            st[k] = torch.zeros(numel, dtype=torch.float32)
            assemble(shards, 0, ("state", k), [(name, 0, numel, 0)], st[k])
        if st:
            for k, v in scalars.get(name, {}).items():
                if torch.is_tensor(v):
                    v = v.clone()
                elif k == "step":  # torch's Adam counts steps in a float32 tensor
                    v = torch.tensor(float(v), dtype=torch.float32)
                st[k] = v
        states[name] = st
    return masters, states
