"""Module surgery: put the plan's parallel layers into the model and quantise them.

Every reference to a replaced module is swapped (T5's shared embedding is reachable as
`shared`, `encoder.embed_tokens` and `decoder.embed_tokens`), a tied LM head keeps sharing its
token embedding's storage, and the attention modules' head counts become the local ones.
Weights are copied slice by slice from the original module or, when a checkpoint will fill
them (`copy_weights=False`), left empty, so a model built on the meta device is never
materialised whole.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .groups import TPGroup
from .layers import ParallelEmbedding, ParallelLinear, _ShardedWeight, local_part
from ..tensor_parallel.plan import HEAD_ATTRS, HEAD_DIM_ATTRS, LayerShard, ShardPlan, Style
from .quantize import group_size_for
from ..tensor_parallel.structure import find_blocks, linear_shape, module_names, token_embedding


@dataclass
class SurgeryReport:
    replaced: Dict[str, int] = field(default_factory=dict)  # "column Linear" -> count
    ties: List[Tuple[_ShardedWeight, _ShardedWeight]] = field(default_factory=list)  # (follower, leader)
    empty: List[Tuple[str, torch.Tensor]] = field(default_factory=list)  # built without data: the checkpoint's

    def count(self, what: str) -> None:
        self.replaced[what] = self.replaced.get(what, 0) + 1

    def summary(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in sorted(self.replaced.items()))


def _set_everywhere(model: nn.Module, names: List[str], new: nn.Module) -> None:
    for name in names:
        parent_path, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, leaf, new)


def _build(orig: nn.Module, shard: Optional[LayerShard], tpg: TPGroup, device, dtype, copy: bool) -> nn.Module:
    if shard is not None and shard.style is Style.HEAD_EMBEDDING:
        new = nn.Embedding(shard.in_features, shard.out_features // tpg.size, device=device, dtype=dtype)
        new.weight.requires_grad_(False)
        new.tp_shard = (shard, tpg.size, tpg.rank)  # the checkpoint loader cuts its slice by this
        if copy:
            new.weight.data.copy_(local_part(orig.weight, shard, tpg.size, tpg.rank, "weight"))
        return new
    if isinstance(orig, nn.Embedding):
        new = ParallelEmbedding(shard, orig.num_embeddings, orig.embedding_dim, tpg.size, tpg.rank, tpg.group,
                                orig.padding_idx, device=device, dtype=dtype)
    else:
        fin, fout, conv1d = linear_shape(orig)
        new = ParallelLinear(shard, fin, fout, getattr(orig, "bias", None) is not None, tpg.size, tpg.rank,
                             tpg.group, conv1d=conv1d, device=device, dtype=dtype)
    if copy:
        new.load_full_("weight", orig.weight)
        if getattr(orig, "bias", None) is not None:
            new.load_full_("bias", orig.bias)
    return new


def apply_plan(model: nn.Module, plan: Optional[ShardPlan], tpg: TPGroup, dtype: torch.dtype, device,
               copy_weights: bool, whole_too: bool) -> SurgeryReport:
    """Replace the planned layers; with `whole_too` (int8) also every other projection and the
    token embedding, as whole (replicated) layers that can hold int8 weights."""
    report = SurgeryReport()
    names = module_names(model)
    modules = dict(model.named_modules())
    todo: List[Tuple[str, Optional[LayerShard]]] = [(s.name, s) for s in (plan.layers if plan else [])]
    if whole_too:
        planned = {name for name, _ in todo}
        emb = token_embedding(model, find_blocks(model))
        todo += [(name, None) for name, m in modules.items()
                 if name and name not in planned and (linear_shape(m) or m is emb)]
    done = set()
    leaders: Dict[int, _ShardedWeight] = {}  # id(original weight) -> the first layer built from it
    for name, shard in todo:
        orig = modules[name]
        if id(orig) in done:
            continue
        done.add(id(orig))
        copy = copy_weights and orig.weight.device.type != "meta"
        new = _build(orig, shard, tpg, device, dtype, copy)
        leader = leaders.get(id(orig.weight))
        if isinstance(new, _ShardedWeight):
            if leader is not None and leader.weight.shape == new.weight.shape:
                new.share_weight_(leader)  # GPT-2 / T5 tie the LM head to the token embedding
                report.ties.append((new, leader))
            else:
                leaders[id(orig.weight)] = new
        if not copy:
            report.empty += [(f"{name}.{p}", t) for p, t in new.named_parameters()]
        _set_everywhere(model, names[id(orig)], new)
        kind = shard.style.value if shard is not None else "replicated"
        report.count(f"{kind} {type(orig).__name__}")
    for a in (plan.attrs if plan else []):
        setattr(modules[a.module], a.attr, a.local)
    return report


def quantize_layers(model: nn.Module, report: SurgeryReport, q_groups: Optional[int], extra_grouping: bool) -> int:
    """Quantise every parallel layer's own (local) weight to int8; tied layers share the result.
    Returns the number of layers quantised."""
    followers = {id(f) for f, _ in report.ties}
    parents = {id(c): p for p in model.modules() for c in p.children()}
    count = 0
    for m in {id(m): m for m in model.modules() if isinstance(m, _ShardedWeight)}.values():
        if id(m) in followers or m.quantized:
            continue
        full_in = m.full_in if isinstance(m, ParallelLinear) else m.embedding_dim
        local_in = m.in_features if isinstance(m, ParallelLinear) else m.embedding_dim
        parent = parents.get(id(m))
        # DeepSpeed's mlp_extra_grouping: twice the groups for the MLP projections
        mlp = parent is not None and not any(hasattr(parent, a) for a in HEAD_ATTRS + HEAD_DIM_ATTRS) \
            and not any(k in type(parent).__name__.lower() for k in ("attention", "attn"))
        m.quantize_(group_size_for(full_in, local_in, q_groups, extra_grouping and mlp))
        count += 1
    for follower, leader in report.ties:
        follower.share_weight_(leader)
    return count
