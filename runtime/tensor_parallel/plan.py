"""The tensor-parallel sharding plan: which layer is split how, and the shard maths.

Megatron-style, for a tensor-parallel group of size tp:
- column-parallel: a projection reading the residual stream (q/k/v, the first MLP projection)
  keeps out_features/tp output rows; fused outputs (GPT-2's c_attn = [q|k|v]) are split part
  by part so each rank holds whole heads of q, k and v;
- row-parallel: the projection writing back to the residual stream (attention output, second
  MLP projection) keeps in_features/tp input columns; its partial sums are all-reduced;
- vocab-parallel: the token embedding and the LM head hold vocab/tp rows each (rounded up,
  the last rank padded), where the table is at least as large as a block's largest
  projection; smaller tables stay whole on every rank;
- head-split: an embedding inside an attention module with one column per head (T5's
  relative position bias) keeps its rank's heads;
- the attention module's head counts and widths (num_heads, split_size, inner_dim, ...) are
  divided so that its reshapes see the local heads.

With an `injection_policy` ({BlockClass: ('attn.o', 'mlp.wo')}) the named projections of that
block class are row-parallel and every other projection in it column-parallel. Without one,
a projection is row-parallel when it writes the block's hidden width and either a norm of
that width follows it in registration order (GPT-2, GPT-Neo, BERT, T5), or it is the block's
last projection, or its name is a known output projection (o_proj, out_proj, down_proj, ...;
Llama, Mistral, GPT-J).

Building a plan only reads the model. Everything that cannot be split evenly is refused here,
before any module is touched.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..core.strict import ConfigError
from .shard import even_range, vocab_range
from .structure import (Block, LinearInfo, block_items, block_linears, find_blocks, lm_head, norm_width,
                        parent_name, token_embedding)

ROW_NAMES = ("o_proj", "out_proj", "o", "down_proj", "c_proj", "fc_out", "fc2", "wo", "dense_4h_to_h", "w2")
HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "num_attn_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_kv")
WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim", "embed_dim", "hidden_size_per_partition")
HEAD_DIM_ATTRS = ("head_dim", "attention_head_size", "key_value_proj_dim")


class Style(enum.Enum):
    COLUMN = "column"
    ROW = "row"
    VOCAB_EMBEDDING = "vocab-embedding"
    VOCAB_HEAD = "vocab-head"
    HEAD_EMBEDDING = "head-embedding"


@dataclass(frozen=True)
class LayerShard:
    name: str
    style: Style
    in_features: int  # embeddings: num_embeddings
    out_features: int  # embeddings: embedding_dim
    parts: int = 1  # fused outputs split part by part
    conv1d: bool = False


@dataclass(frozen=True)
class AttrShard:
    module: str
    attr: str
    full: int
    local: int


@dataclass
class ShardPlan:
    tp_size: int
    source: str  # "automatic" or "injection_policy"
    layers: List[LayerShard] = field(default_factory=list)
    attrs: List[AttrShard] = field(default_factory=list)
    row_points: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # block class -> row names

    def by_name(self) -> Dict[str, LayerShard]:
        return {s.name: s for s in self.layers}

    def summary(self) -> str:
        counts: Dict[str, int] = {}
        for s in self.layers:
            counts[s.style.value] = counts.get(s.style.value, 0) + 1
        rows = "; ".join(f"{cls}: {', '.join(names)}" for cls, names in self.row_points.items())
        parts = ", ".join(f"{n} {k}" for k, n in counts.items())
        return f"tensor parallel x{self.tp_size} ({self.source}): {parts}; all-reduce after [{rows}]"


# ---------------------------------------------------------------- shard maths (tensor_parallel/shard.py)

def split_ranges(shard: LayerShard, tp: int, rank: int) -> List[Tuple[int, int]]:
    """The ranges of the split dimension (output rows, or input columns for ROW) this rank keeps."""
    if shard.style is Style.ROW:
        return [even_range(shard.in_features, tp, rank)]
    if shard.style in (Style.VOCAB_EMBEDDING, Style.VOCAB_HEAD):
        start, stop, _ = vocab_range(shard.in_features if shard.style is Style.VOCAB_EMBEDDING
                                     else shard.out_features, tp, rank)
        return [(start, stop)]
    width = shard.out_features // shard.parts
    lo, hi = even_range(width, tp, rank)
    return [(p * width + lo, p * width + hi) for p in range(shard.parts)]


# ---------------------------------------------------------------- planning

class InferenceConfigError(ConfigError):
    """A bad init_inference argument, phrased as the one line the user sees (exit 2 uncaught).

    Defined with the planner, which checks what the model-facing arguments ask for
    (injection_policy, a tp size the layers can be split by); inference/config.py raises it
    for the rest of init_inference's arguments."""


def _fail(msg: str) -> InferenceConfigError:
    return InferenceConfigError(f"tensor parallel: {msg}")


def _auto_rows(block: Block, linears: List[LinearInfo]) -> List[LinearInfo]:
    hidden = linears[0].in_features
    order = [(rel, m) for rel, m in block_items(block) if norm_width(m) or any(li.rel == rel for li in linears)]
    rows = []
    for i, (rel, _) in enumerate(order):
        li = next((x for x in linears if x.rel == rel), None)
        if li is None or li.out_features != hidden:
            continue
        nxt = order[i + 1][1] if i + 1 < len(order) else None
        followed_by_norm = nxt is not None and norm_width(nxt) == hidden
        if followed_by_norm or li is linears[-1] or rel.rsplit(".", 1)[-1] in ROW_NAMES:
            rows.append(li)
    return rows


def _policy_rows(block: Block, linears: List[LinearInfo], names: Sequence[str]) -> List[LinearInfo]:
    return [li for li in linears if any(li.rel == n or li.rel.endswith("." + n) for n in names)]


def _check_policy(model: nn.Module, blocks: List[Block], policy: Dict[Any, Tuple[str, ...]]) -> Dict[type, Tuple]:
    resolved = {}
    by_class_name = {b.cls.__name__: b.cls for b in blocks}
    for key, names in policy.items():
        cls = key if isinstance(key, type) else by_class_name.get(key)
        label = getattr(key, "__name__", key)
        if cls is None or not any(isinstance(b.module, cls) for b in blocks):
            present = sorted({type(m).__name__ for m in model.modules()})
            if label not in present:
                from ..core.strict import suggest

                raise InferenceConfigError(f"injection_policy: the model has no {label} module"
                                           f"{suggest(str(label), present)}")
            raise InferenceConfigError(f"injection_policy: {label} is not a repeated block (an element of an "
                                       "nn.ModuleList holding projections)")
        mine = [b for b in blocks if isinstance(b.module, cls)]
        rels = sorted({rel for b in mine for rel, _ in block_items(b)})
        for n in names:
            hits = [rel for rel in rels if rel == n or rel.endswith("." + n)]
            if not hits:
                from ..core.strict import suggest

                raise InferenceConfigError(f"injection_policy[{label}]: no module named {n!r} in {label}"
                                           f"{suggest(n, rels)}")
            for b in mine:
                for rel, m in block_items(b):
                    if rel in hits and not any(li.rel == rel for li in block_linears(b)):
                        raise InferenceConfigError(f"injection_policy[{label}]: {n!r} is a "
                                                   f"{type(m).__name__}, not a Linear/Conv1D projection")
        resolved[cls] = names
    return resolved


def _divide_attrs(module: nn.Module, mname: str, tp: int, width: int, plan: ShardPlan) -> None:
    for attr in HEAD_ATTRS + KV_HEAD_ATTRS + WIDTH_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if attr in WIDTH_ATTRS and value != width:
            continue  # a width that is not the sharded one (e.g. a model dimension) stays whole
        if value % tp:
            kind = "attention heads" if attr in HEAD_ATTRS else "key/value heads" if attr in KV_HEAD_ATTRS \
                else f"{attr}"
            raise _fail(f"tp size {tp} does not divide the {value} {kind} of {mname} "
                        f"({type(module).__name__}.{attr})")
        plan.attrs.append(AttrShard(mname, attr, value, value // tp))


def _check_heads(module: nn.Module, mname: str, li: LinearInfo, parts: int, tp: int) -> None:
    """A column split must fall between heads: each part's heads must divide by tp."""
    head_dim = next((getattr(module, a) for a in HEAD_DIM_ATTRS if isinstance(getattr(module, a, None), int)), None)
    if not head_dim or (li.out_features // parts) % head_dim:
        return
    heads = li.out_features // parts // head_dim
    if heads % tp:
        raise _fail(f"tp size {tp} does not divide the {heads} heads that {li.name} projects to "
                    f"({type(module).__name__})")


def plan_tensor_parallel(model: nn.Module, tp: int, policy: Optional[Dict[Any, Tuple[str, ...]]] = None,
                         ) -> ShardPlan:
    """Build the plan for `tp` ranks, or raise InferenceConfigError naming what cannot be split."""
    blocks = find_blocks(model)
    plan = ShardPlan(tp_size=tp, source="injection_policy" if policy else "automatic")
    if not blocks:
        raise _fail(f"found no repeated blocks (nn.ModuleList of layers with projections) in "
                    f"{type(model).__name__}; nothing to split")
    resolved = _check_policy(model, blocks, policy) if policy else None
    modules = dict(model.named_modules())
    largest = 0
    for block in blocks:
        linears = block_linears(block)
        if resolved is not None:
            names = next((n for c, n in resolved.items() if isinstance(block.module, c)), None)
            if names is None:
                continue  # a block type the policy does not name stays whole
            rows = _policy_rows(block, linears, names)
        else:
            rows = _auto_rows(block, linears)
        if not rows:
            raise _fail(f"cannot tell the all-reduce points of {block.cls.__name__} ({block.name}); "
                        "pass injection_policy={Block: ('attn.out_proj', 'mlp.down_proj')}")
        known = plan.row_points.get(block.cls.__name__, ())
        plan.row_points[block.cls.__name__] = tuple(sorted(set(known) | {r.rel for r in rows}))
        row_names = {r.name for r in rows}
        for i, li in enumerate(linears):
            largest = max(largest, li.in_features * li.out_features)
            if li.name in row_names:
                if li.in_features % tp:
                    raise _fail(f"tp size {tp} does not divide the {li.in_features} input features of {li.name}")
                plan.layers.append(LayerShard(li.name, Style.ROW, li.in_features, li.out_features,
                                              conv1d=li.conv1d))
                continue
            partner = next((r for r in linears[i + 1:] if r.name in row_names), None)
            if partner is None:
                raise _fail(f"{li.name} has no row-parallel projection after it in {block.cls.__name__}; "
                            "its output would stay split")
            parts = li.out_features // partner.in_features \
                if li.out_features > partner.in_features and li.out_features % partner.in_features == 0 else 1
            if (li.out_features // parts) % tp:
                raise _fail(f"tp size {tp} does not divide the {li.out_features // parts} output features "
                            f"of {li.name}")
            owner = parent_name(li.name)
            _check_heads(modules[owner], owner, li, parts, tp)
            plan.layers.append(LayerShard(li.name, Style.COLUMN, li.in_features, li.out_features, parts,
                                          li.conv1d))
            if not any(a.module == owner for a in plan.attrs):
                _divide_attrs(modules[owner], owner, tp, partner.in_features, plan)
                heads = next((a.full for a in plan.attrs if a.module == owner and a.attr in HEAD_ATTRS), None)
                for rel, m in modules[owner].named_children():
                    if isinstance(m, nn.Embedding) and heads and m.embedding_dim == heads:
                        plan.layers.append(LayerShard(f"{owner}.{rel}", Style.HEAD_EMBEDDING, m.num_embeddings,
                                                      m.embedding_dim))
    _plan_vocab(model, blocks, tp, largest, plan)
    return plan


def _plan_vocab(model: nn.Module, blocks: List[Block], tp: int, largest: int, plan: ShardPlan) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    emb = token_embedding(model, blocks)
    if emb is not None and emb.num_embeddings * emb.embedding_dim >= largest:
        plan.layers.append(LayerShard(names[id(emb)], Style.VOCAB_EMBEDDING, emb.num_embeddings, emb.embedding_dim))
    head = lm_head(model, blocks, emb)
    if head is not None and head.in_features * head.out_features >= largest and id(head) in names:
        plan.layers.append(LayerShard(names[id(head)], Style.VOCAB_HEAD, head.in_features, head.out_features))
