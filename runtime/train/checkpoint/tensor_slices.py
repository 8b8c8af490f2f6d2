"""Checkpoints across tensor-parallel sizes: re-cut every slice's shards for another size.

A tensor-parallel checkpoint holds one model-states file per tensor rank (`mp_rank_XX`,
DeepSpeed's layout) and, under ZeRO, optimizer shards per (data rank, tensor rank). Each
sharded parameter keeps the same name on every tensor rank; how its local tensor sits in
the full one (the split dim, fused parts, vocabulary padding, HF Conv1D's transposed
layout) is a `tensor_parallel.ParamShard`, recorded per name at save under
"dslaunch"/"tensor_parallel_shards" and known from the resuming model's own layers.

Resuming at another tensor size (or a tensor-parallel checkpoint at tp=1, or the reverse):
every saved slice's module state and optimizer state is made whole per name (reshard.py's
name-keyed shards), the slices are assembled into full tensors by their ParamShard, and this
rank's slice of the new size is cut from them. The optimizer state comes out as one
name-keyed shard holding this tensor rank's parameters whole, which the ZeRO strategies
then cut for the current data-parallel layout as any other re-shard. Parameters without a
ParamShard are replicated: slice 0's copy is taken.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from ...core.errors import CheckpointError
from ...core.shard_state import ShardKind
from ...tensor_parallel.layers import ParamShard, TensorParallelLayer
from ...zero.reshard import whole_optimizer_state


def shard_specs(module: torch.nn.Module) -> Dict[str, Dict[str, Any]]:
    """name -> the ParamShard fields of every tensor-parallel parameter of `module` (saved)."""
    out = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        if isinstance(mod, TensorParallelLayer):
            for pname, spec in mod.param_shards().items():
                if spec.dim is not None:
                    out[f"{mname}.{pname}" if mname else pname] = {
                        "dim": spec.dim, "full": spec.full, "parts": list(spec.parts), "vocab": spec.vocab,
                        "conv1d": spec.conv1d, "sizes": list(spec.sizes),
                        "sub_widths": [list(w) for w in spec.sub_widths]}
    return out


def _specs(saved: Dict[str, Dict[str, Any]], module: Optional[torch.nn.Module]):
    merged = dict(saved or {})
    if module is not None:
        merged.update(shard_specs(module))
    return {n: spec_of(d) for n, d in merged.items()}


def spec_of(d: Dict[str, Any]) -> ParamShard:
    """A saved shard_specs entry as a ParamShard (uneven sizes and sub-parameter widths are
    recorded since they are known; older entries split evenly)."""
    return ParamShard(dim=d["dim"], full=d["full"], parts=tuple(d.get("parts") or ()), vocab=bool(d.get("vocab")),
                      conv1d=bool(d.get("conv1d")), sizes=tuple(d.get("sizes") or ()),
                      sub_widths=tuple(tuple(w) for w in d.get("sub_widths") or ()))


def cut_whole(module_state: Dict[str, torch.Tensor], shard: Dict[str, Any], module: torch.nn.Module, tp: int,
              rank: int, path: str):
    """Tensor rank `rank`'s module state and one-shard optimizer state (reshard.py's form,
    stage 0, every parameter whole, e.g. a universal folder's) cut by the split each of
    `module`'s tensor-parallel parameters records; unsplit ones stay whole."""
    specs = _specs({}, module)
    local = _retile([module_state], specs, tp, rank, path)
    if shard is None:
        return local, None
    out = dict(shard, groups=[])
    for g in shard["groups"]:
        ng = {"pieces": [], "shapes": {}, "master": {}, "state": {k: ({} if isinstance(v, dict) else v)
                                                                  for k, v in g["state"].items()}}
        for piece in g["pieces"]:
            name = piece["name"]
            shape, spec = g["shapes"][name], specs.get(name)
            if piece["start"] != 0 or piece["end"] != int(torch.Size(shape).numel()):
                raise CheckpointError(f"checkpoint {path}: {name} is not whole in the optimizer state being cut")

            def cut(t: torch.Tensor, spec=spec, shape=shape) -> torch.Tensor:
                return t if spec is None else spec.cut(t.view(shape), tp, rank).contiguous()

            master = cut(g["master"][name])
            ng["master"][name] = master.reshape(-1)
            ng["shapes"][name] = list(master.shape) if spec is not None else list(shape)
            ng["pieces"].append({"name": name, "start": 0, "end": master.numel(), "offset": 0})
            for k, v in g["state"].items():
                if isinstance(v, dict) and name in v:
                    ng["state"][k][name] = cut(v[name]).reshape(-1)
        out["groups"].append(ng)
    return local, out


def saved_size(ck) -> int:
    return int(ck.topology.get("model", 1))


def applies(ck, place, pipeline: bool) -> bool:
    """Whether loading `ck` at `place` needs its tensor slices re-cut: tensor parallelism on
    either side, and another topology (the same one loads each rank's own files)."""
    if max(saved_size(ck), place.mp_size) == 1 or ck.topology == place.topology():
        return False
    if pipeline or ck.layers or ck.topology.get("pipe", 1) > 1:
        raise CheckpointError(f"checkpoint {ck.path} was saved at topology {ck.topology} and this job runs "
                              f"{place.topology()}: re-cutting a pipeline's tensor slices is not supported; resume "
                              f"at the topology that saved it (or consolidate it and load the full weights)")
    if ck.kind is ShardKind.PER_PARAMETER:
        raise CheckpointError(f"checkpoint {ck.path}: a ZeRO-3 checkpoint with tensor slices cannot be re-cut")
    return True


def _saved_specs(ck) -> Dict[str, Dict[str, Any]]:
    return (ck.model_of(0).get("dslaunch") or {}).get("tensor_parallel_shards") or {}


def _retile(per_slice: List[Dict[str, torch.Tensor]], specs, tp: int, rank: int, path: str
            ) -> Dict[str, torch.Tensor]:
    """name -> this rank's tensor at size `tp` from every saved slice's tensors (shaped as
    saved). Saved at size 1, a tensor is the full one in the module's own layout; resumed at
    size 1, the full one is what the module holds."""
    out = {}
    for name, first in per_slice[0].items():
        spec = specs.get(name)
        if spec is None:
            out[name] = first
            continue
        missing = [s for s, st in enumerate(per_slice) if name not in st]
        if missing:
            raise CheckpointError(f"checkpoint {path}: {name} is missing from tensor slice {missing[0]}")
        full = first if len(per_slice) == 1 else spec.assemble([st[name] for st in per_slice])
        out[name] = full if tp == 1 else spec.cut(full, tp, rank).contiguous()
    return out


def _infer_specs(per_slice: List[Dict[str, torch.Tensor]], module: Optional[torch.nn.Module], specs) -> None:
    """Splits neither recorded nor known from the model (a checkpoint DeepSpeed wrote, resumed
    into a model that is not split): a saved slice whose shape differs from the model's full
    one along a single dim was cut evenly along it, in rank order (DeepSpeed's AutoTP and
    Megatron cut so), its rows padded only by a vocabulary split."""
    if module is None or len(per_slice) == 1:
        return
    full = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    tp = len(per_slice)
    for name, local in per_slice[0].items():
        if name in specs or name not in full or tuple(local.shape) == full[name]:
            continue
        dims = [d for d, (a, b) in enumerate(zip(local.shape, full[name])) if a != b]
        if len(local.shape) != len(full[name]) or len(dims) != 1:
            continue  # left to the shape check, which names it
        d = dims[0]
        if local.shape[d] * tp == full[name][d]:
            specs[name] = ParamShard(dim=d, full=full[name][d])
        elif d == 0 and local.shape[0] == -(-full[name][0] // tp):
            specs[name] = ParamShard(dim=0, full=full[name][0], vocab=True)


def module_state(ck, module: Optional[torch.nn.Module], tp: int, rank: int) -> Dict[str, torch.Tensor]:
    """The module state for tensor rank `rank` of `tp` (tp=1: the full model)."""
    specs = _specs(_saved_specs(ck), module)
    per_slice = [ck.model_of(s)["module"] for s in range(saved_size(ck))]
    _infer_specs(per_slice, module, specs)
    return _retile(per_slice, specs, tp, rank, ck.path)


def optimizer_shard(ck, module: Optional[torch.nn.Module], tp: int, rank: int,
                    slice_shards: Callable[[int], List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One name-keyed shard with this tensor rank's parameters whole (fp32 weights and
    optimizer state), cut from every saved slice (`slice_shards(s)`: slice s's name-keyed shards)."""
    specs = _specs(_saved_specs(ck), module)
    masters: List[Dict[str, torch.Tensor]] = []
    states: List[Dict[str, Dict[str, Any]]] = []
    hyper = None
    for s in range(saved_size(ck)):
        shards = slice_shards(s)
        if hyper is None:
            hyper = shards[0].get("param_groups")
        shapes: Dict[str, List[int]] = {}
        for x in shards:
            for g in x["groups"]:
                shapes.update({n: list(v) for n, v in g["shapes"].items()})
        m, st = whole_optimizer_state(shards, {n: int(torch.Size(v).numel()) for n, v in shapes.items()})
        masters.append({n: t.view(shapes[n]) for n, t in m.items()})
        states.append({n: {k: (v.view(shapes[n]) if torch.is_tensor(v) and v.numel() == m[n].numel() else v)
                           for k, v in kv.items()} for n, kv in st.items()})
    _infer_specs(masters, module, specs)
    new_masters = _retile(masters, specs, tp, rank, ck.path)
    group: Dict[str, Any] = {"pieces": [], "shapes": {}, "master": {}, "state": {}}
    for name, t in new_masters.items():
        group["shapes"][name] = list(t.shape)
        group["master"][name] = t.reshape(-1).float()
        group["pieces"].append({"name": name, "start": 0, "end": t.numel(), "offset": 0})
    keys = sorted({k for st in states[0].values() for k in st})
    for k in keys:
        per = [{n: kv[k] for n, kv in st.items() if k in kv} for st in states]
        tensors = {n: v for n, v in per[0].items() if torch.is_tensor(v) and v.shape == masters[0][n].shape}
        if tensors:
            cut = _retile([{n: p[n] for n in tensors} for p in per], specs, tp, rank, ck.path)
            group["state"][k] = {n: v.reshape(-1).float() for n, v in cut.items()}
        else:
            group["state"][k] = next(iter(per[0].values()))  # a scalar (Adam's step), alike for every parameter
    return [{"format": "dslaunch-zero-shard/1", "stage": 0, "world_size": 1, "rank": 0, "groups": [group],
             "param_groups": hyper or []}]
