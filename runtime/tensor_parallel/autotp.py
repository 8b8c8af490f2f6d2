"""Automatic tensor parallelism for training: shard a Hugging Face model in place.

`shard_model_for_training(model, group, tp_size, tp_rank, partition_config=None)` replaces the
model's projections and embeddings with the trainable layers of layers.py, holding this rank's
slices, and divides the attention modules' head counts and widths so that their reshapes see
the local heads. Which layer is split how comes from, in DeepSpeed 0.19's order of priority:

1. `partition_config` (DeepSpeed's AutoTP training key, `tensor_parallel.partition_config`):
   `layer_specs` of regex `patterns` matched (re.match, as DeepSpeed) against parameter names
   such as `model.layers.0.self_attn.q_proj.weight`, with `partition_type` column / row /
   skip, `gather_output`, `grad_allreduce` (skip: sum the replicated parameter's gradient over
   the group), `shape` + `partition_dim` for fused outputs ((3, -1): three equal parts;
   ((q, k, v), -1): unequal grouped-query parts), `model_types`; `lm_head_patterns`;
   `strict_mode` (every projection must match a spec). Unlike DeepSpeed, a pattern that
   matches nothing is an error, an embedding a spec names is split by vocabulary, and an LM
   head a column spec names is split by vocabulary with its logits gathered (the model's loss
   needs them whole).
2. the model's own Hugging Face tensor-parallel plan (`config.base_model_tp_plan` and the
   class's `_tp_plan`): colwise, rowwise, colwise_gather_output (colwise_rep),
   embedding_rowwise (kept whole), replicated_with_grad_allreduce;
3. otherwise the structural plan inference uses (plan.py): GPT-2's Conv1D,
   GPT-Neo/J, BERT, T5, Llama/Mistral, with vocabulary-parallel embeddings and LM heads.

A tied LM head and token embedding stay tied: both become vocabulary-parallel with one shared
local weight. Everything is planned and checked before the first module changes, and what
cannot be split (tp not dividing heads, key/value heads or a width, a pattern matching
nothing, an unknown style) is one TensorParallelError line.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..core import comm
from .layers import (ColumnParallelLinear, HeadParallelEmbedding, RowParallelLinear, TensorParallelLayer,
                     VocabParallelEmbedding, VocabParallelLMHead)
from ..core.config.partition import LayerSpec, PartitionConfig, parse_partition_config
from .plan import HEAD_DIM_ATTRS, InferenceConfigError, ShardPlan, Style, _divide_attrs, plan_tensor_parallel
from .shard import TensorParallelError, linear_shape

HF_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "replicated_with_grad_allreduce",
             "embedding_rowwise")


def _fail(msg: str) -> TensorParallelError:
    return TensorParallelError(f"tensor parallel: {msg}")


def hf_tp_plan(model: nn.Module) -> Optional[Dict[str, str]]:
    """The model's Hugging Face tensor-parallel plan: config.base_model_tp_plan, the class's
    _tp_plan and the instance's, merged (an entry also present without the `model.` prefix once)."""
    config = getattr(model, "config", None)
    merged: Dict[str, str] = {}
    seen = set()
    for plan in (getattr(config, "base_model_tp_plan", None), getattr(type(model), "_tp_plan", None),
                 getattr(model, "__dict__", {}).get("_tp_plan")):
        if not isinstance(plan, dict):
            continue
        for pattern, style in plan.items():
            canonical = pattern[len("model."):] if pattern.startswith("model.") else pattern
            if pattern.startswith("model.") and canonical in seen:
                continue
            merged[pattern] = style
            seen.add(canonical)
    return merged or None


def partition_config_from_hf_plan(plan: Dict[str, str]) -> PartitionConfig:
    """A Hugging Face tp plan ({'layers.*.self_attn.q_proj': 'colwise', ...}) as layer specs."""
    specs = []
    for pattern, style in plan.items():
        s = str(style).lower()
        if s not in HF_STYLES:
            raise _fail(f"the model's Hugging Face tp plan has style {style!r} for {pattern!r}, which dslaunch does "
                        "not support; give tensor_parallel.partition_config instead")
        regex = ".*" + pattern.replace(".", r"\.").replace("*", ".*")
        regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
        ptype = "column" if s.startswith("colwise") else "row" if s == "rowwise" else "skip"
        specs.append(LayerSpec((regex,), ptype, gather_output=s in ("colwise_rep", "colwise_gather_output"),
                               grad_allreduce=s == "replicated_with_grad_allreduce",
                               where=f"the Hugging Face tp plan entry {pattern!r}"))
    return PartitionConfig(specs, source="the model's Hugging Face tp plan")


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Decision:
    name: str
    kind: str  # column | row | vocab-embedding | vocab-head | head-embedding
    parts: Optional[Tuple[int, ...]] = None
    gather_output: bool = False


@dataclass
class TrainingShardPlan:
    tp_size: int
    source: str
    decisions: List[Decision] = field(default_factory=list)
    attrs: List[Tuple[str, str, int]] = field(default_factory=list)  # (module, attr, local value)
    grad_allreduce: List[str] = field(default_factory=list)  # replicated parameters whose grads are summed

    def summary(self) -> str:
        counts: Dict[str, int] = {}
        for d in self.decisions:
            counts[d.kind] = counts.get(d.kind, 0) + 1
        parts = ", ".join(f"{n} {k}" for k, n in counts.items())
        extra = f", {len(self.grad_allreduce)} replicated with gradient all-reduce" if self.grad_allreduce else ""
        return f"tensor parallel x{self.tp_size} for training ({self.source}): {parts}{extra}"


def _model_type(model: nn.Module) -> Optional[str]:
    t = getattr(getattr(model, "config", None), "model_type", None)
    return str(t).lower() if t else None


def _tied_partner(model: nn.Module, module: nn.Module) -> Optional[str]:
    for name, m in model.named_modules():
        if m is not module and getattr(m, "weight", None) is getattr(module, "weight", object()):
            return name
    return None


def _plan_from_specs(model: nn.Module, tp: int, cfg: PartitionConfig) -> TrainingShardPlan:
    if cfg.tp_size is not None and cfg.tp_size != tp:
        raise _fail(f"partition_config.tp_size is {cfg.tp_size} but the tensor-parallel size is {tp}")
    plan = TrainingShardPlan(tp, cfg.source)
    mtype = _model_type(model)
    modules = dict(model.named_modules())
    used = set()
    decided: Dict[str, Decision] = {}
    for name, m in modules.items():
        w = getattr(m, "weight", None)
        if not name or not isinstance(w, torch.Tensor) or w.dim() != 2:
            continue
        pname = f"{name}.weight"
        spec = next((s for s in cfg.layer_specs if s.matches(pname, mtype)), None)
        if spec is None:
            if cfg.strict_mode and linear_shape(m):
                raise _fail(f"{cfg.source}: strict_mode and no spec matches {pname}")
            continue
        used.add(id(spec))
        if spec.partition_type == "skip":
            continue
        is_head = name.rsplit(".", 1)[-1] in cfg.lm_head_patterns
        if isinstance(m, nn.Embedding):
            decided[name] = Decision(name, "vocab-embedding")
            continue
        shape = linear_shape(m)
        if shape is None:
            raise _fail(f"{spec.where} matches {pname}, a {type(m).__name__}, which is neither a Linear, a Conv1D "
                        "nor an Embedding")
        fin, fout, conv1d = shape
        if spec.partition_type == "row":
            if is_head:
                raise _fail(f"{spec.where}: a row-parallel LM head ({name}) is not supported; make it column")
            if fin % tp:
                raise _fail(f"tp size {tp} does not divide the {fin} input features of {name}")
            decided[name] = Decision(name, "row")
        elif is_head and not conv1d:
            decided[name] = Decision(name, "vocab-head", gather_output=True)
        else:
            parts = spec.part_widths(fout, name)
            for width in parts or (fout,):
                if width % tp:
                    raise _fail(f"tp size {tp} does not divide the {width} output features of {name}")
            decided[name] = Decision(name, "column", parts, spec.gather_output)
    # a replicated parameter whose gradient is summed over the group may be any parameter (a norm's)
    for pname, _ in model.named_parameters():
        spec = next((s for s in cfg.layer_specs if s.matches(pname, mtype)), None)
        if spec is not None and spec.grad_allreduce:
            used.add(id(spec))
            if pname not in plan.grad_allreduce:
                plan.grad_allreduce.append(pname)
    for spec in cfg.layer_specs:
        if id(spec) not in used:
            some = next((f"{n}.weight" for n, m in modules.items()
                         if n and isinstance(getattr(m, "weight", None), torch.Tensor)), "?")
            many = len(spec.patterns) > 1
            raise _fail(f"{spec.where}: pattern{'s' if many else ''} {', '.join(repr(p) for p in spec.patterns)} "
                        f"match{'' if many else 'es'} no parameter of "
                        f"{type(model).__name__} (names look like {some!r})")
    # a tied LM head and token embedding are split together, by vocabulary
    for name in list(decided):
        d = decided[name]
        if d.kind in ("vocab-head", "vocab-embedding"):
            partner = _tied_partner(model, modules[name])
            if partner is not None and partner not in decided:
                kind = "vocab-embedding" if isinstance(modules[partner], nn.Embedding) else "vocab-head"
                if kind == "vocab-head" and linear_shape(modules[partner])[2]:
                    raise _fail(f"{partner} (a Conv1D) is tied to {name}; it cannot be split by vocabulary")
                decided[partner] = Decision(partner, kind, gather_output=kind == "vocab-head")
    plan.decisions = list(decided.values())
    # the attention modules' head counts: divide those of every module owning a split projection
    scratch = ShardPlan(tp, "specs")
    owners: Dict[str, List[Decision]] = {}
    for d in plan.decisions:
        if d.kind in ("column", "row") and "." in d.name and not d.gather_output:
            owners.setdefault(d.name.rsplit(".", 1)[0], []).append(d)
    for owner, ds in owners.items():
        rows = [d for d in ds if d.kind == "row"]
        cols = [d for d in ds if d.kind == "column"]
        if not cols:
            continue
        width = linear_shape(modules[rows[0].name])[0] if rows else \
            min(linear_shape(modules[d.name])[1] // len(d.parts or (1,)) for d in cols)
        module = modules[owner]
        head_dim = next((getattr(module, a) for a in HEAD_DIM_ATTRS if isinstance(getattr(module, a, None), int)),
                        None)
        if head_dim:
            for d in cols:
                for width_part in d.parts or (linear_shape(modules[d.name])[1],):
                    if width_part % head_dim == 0 and (width_part // head_dim) % tp:
                        raise _fail(f"tp size {tp} does not divide the {width_part // head_dim} heads that {d.name} "
                                    f"projects to ({type(module).__name__})")
        _divide_attrs_checked(module, owner, tp, width, scratch, _divide_attrs)
    plan.attrs = [(a.module, a.attr, a.local) for a in scratch.attrs]
    return plan


def _divide_attrs_checked(module, owner, tp, width, scratch, divide) -> None:
    try:
        divide(module, owner, tp, width, scratch)
    except InferenceConfigError as exc:
        raise TensorParallelError(str(exc)) from None


def _plan_structural(model: nn.Module, tp: int) -> TrainingShardPlan:
    try:
        inf = plan_tensor_parallel(model, tp)
    except InferenceConfigError as exc:
        raise TensorParallelError(str(exc)) from None
    kinds = {Style.COLUMN: "column", Style.ROW: "row", Style.VOCAB_EMBEDDING: "vocab-embedding",
             Style.VOCAB_HEAD: "vocab-head", Style.HEAD_EMBEDDING: "head-embedding"}
    plan = TrainingShardPlan(tp, "automatic")
    for s in inf.layers:
        parts = (s.out_features // s.parts,) * s.parts if s.style is Style.COLUMN and s.parts > 1 else None
        plan.decisions.append(Decision(s.name, kinds[s.style], parts, s.style is Style.VOCAB_HEAD))
    plan.attrs = [(a.module, a.attr, a.local) for a in inf.attrs]
    return plan


def plan_training_shards(model: nn.Module, tp_size: int, partition_config: Any = None) -> TrainingShardPlan:
    """Which layer of `model` is split how at `tp_size` (pure: reads the model, changes nothing;
    raises TensorParallelError for what cannot be split)."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise _fail(f"tp size must be a positive integer, got {tp_size!r}")
    if partition_config is not None:
        return _plan_from_specs(model, tp_size, parse_partition_config(partition_config))
    hf = hf_tp_plan(model)
    if hf:
        return _plan_from_specs(model, tp_size, partition_config_from_hf_plan(hf))
    if any(isinstance(m, TensorParallelLayer) for m in model.modules()):
        # the script split the layers itself (DeepSpeed's LinearLayer / LinearAllreduce built by
        # hand): its split stands, and no automatic choice is laid over it
        return TrainingShardPlan(tp_size, "the script's own tensor-parallel layers")
    return _plan_structural(model, tp_size)


# ---------------------------------------------------------------- surgery

def _build(model_module: nn.Module, d: Decision, group, tp: int, rank: int) -> nn.Module:
    if d.kind == "column":
        return ColumnParallelLinear.from_linear(model_module, group, tp, rank, gather_output=d.gather_output,
                                                parts=d.parts, label=d.name)
    if d.kind == "row":
        return RowParallelLinear.from_linear(model_module, group, tp, rank, label=d.name)
    if d.kind == "vocab-embedding":
        return VocabParallelEmbedding.from_embedding(model_module, group, tp, rank, label=d.name)
    if d.kind == "vocab-head":
        return VocabParallelLMHead.from_linear(model_module, group, tp, rank, gather_output=True, label=d.name)
    # head-embedding: one column per attention head (T5's relative position bias)
    return HeadParallelEmbedding.from_embedding(model_module, group, tp, rank, label=d.name)


def _grad_allreduce_hook(group, name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, op=comm.ReduceOp.SUM, group=group, label=f"tp grad all-reduce {name}")
        return grad

    return hook


def _broadcast_model(model: nn.Module, group: Any) -> None:
    """Every parameter and buffer from the group's first rank, before anything is cut: ranks
    that built the model with different seeds (the default generator differs per rank) would
    otherwise hold shards of different models and replicated copies that disagree."""
    # a layer the script split already (DeepSpeed's LinearLayer built by hand) holds this
    # rank's own block: nothing of it is sent
    seen = {id(t) for m in model.modules() if isinstance(m, TensorParallelLayer)
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))}
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            data = t.data if t.is_contiguous() else t.data.contiguous()
            comm.broadcast(data, group=group, group_src=0, label=f"tp initial weights {name}")
            if data is not t.data:
                t.data.copy_(data)


def _follow_ties(model: nn.Module, modules: Dict[str, nn.Module], plan: TrainingShardPlan,
                 built: Dict[int, Tuple[TensorParallelLayer, str]], names: Dict[int, List[str]]) -> None:
    """Other holders of a parameter that was split. An embedding sharing a split embedding's
    weight (T5's encoder.embed_tokens, a module of its own sharing `shared.weight`) becomes
    that split module, so the tie and its gradients stay whole; a module that only holds the
    parameter (BERT's prediction head keeps `bias`, tied to its decoder's) holds the local
    shard instead; a projection that would compute with it cannot follow and is refused."""
    replaced = {id(modules[d.name]) for d in plan.decisions}
    for name, m in modules.items():
        if id(m) in replaced or isinstance(m, TensorParallelLayer):
            continue
        for pname, param in list(m._parameters.items()):
            if param is None or id(param) not in built:
                continue
            layer, new_name = built[id(param)]
            if isinstance(m, nn.Embedding) and isinstance(layer, VocabParallelEmbedding) and pname == "weight":
                for path in names[id(m)]:
                    parent_path, _, leaf = path.rpartition(".")
                    setattr(model.get_submodule(parent_path) if parent_path else model, leaf, layer)
                break
            if isinstance(m, (nn.Embedding, nn.Linear)) or linear_shape(m):
                raise _fail(f"{name} shares its {pname} with {layer.label}, which is split "
                            f"({type(layer).__name__}); a {type(m).__name__} cannot follow it")
            setattr(m, pname, getattr(layer, new_name))


def shard_model_for_training(model: nn.Module, group: Any, tp_size: int, tp_rank: int,
                             partition_config: Any = None) -> TrainingShardPlan:
    """Replace `model`'s layers in place with trainable tensor-parallel ones holding rank
    `tp_rank`'s slices of a `tp_size`-rank `group` (None when tp_size is 1); returns the plan
    applied. Every rank of the group must call it with the same architecture; the weights are
    first broadcast from the group's rank 0 (one collective per parameter and buffer), so all
    ranks cut their slices out of the same model."""
    plan = plan_training_shards(model, tp_size, partition_config)
    if getattr(model, "ds_autotp_parsed", False):
        raise _fail(f"{type(model).__name__} is already sharded for tensor parallelism")
    if tp_size > 1:
        size = comm.get_world_size(group) if group is not None and comm.is_initialized() else 1
        if size != tp_size:
            raise _fail(f"tp size {tp_size} but the group given has {size} rank{'s' if size != 1 else ''}")
    if tp_size == 1:
        setattr(model, "ds_autotp_parsed", True)
        return plan
    _broadcast_model(model, group)
    names: Dict[int, List[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    modules = dict(model.named_modules())
    leaders: Dict[int, TensorParallelLayer] = {}  # id(original weight) -> the layer built first from it
    built: Dict[int, Tuple[TensorParallelLayer, str]] = {}  # id(original parameter) -> (layer, its name there)
    for d in plan.decisions:
        orig = modules[d.name]
        new = _build(orig, d, group, tp_size, tp_rank)
        for p_new, p_old in ((getattr(new, "weight", None), orig.weight), (getattr(new, "bias", None),
                                                                          getattr(orig, "bias", None))):
            if isinstance(p_new, nn.Parameter) and isinstance(p_old, torch.Tensor):
                p_new.requires_grad_(p_old.requires_grad)
        leader = leaders.get(id(orig.weight))
        if leader is not None and leader.weight.shape == new.weight.shape:
            new.weight = leader.weight  # a tied LM head and token embedding share one local weight
        elif isinstance(new, TensorParallelLayer):
            leaders[id(orig.weight)] = new
        for pname in ("weight", "bias"):
            if isinstance(getattr(orig, pname, None), torch.Tensor) and isinstance(getattr(new, pname, None),
                                                                                  nn.Parameter):
                built.setdefault(id(getattr(orig, pname)), (new, pname))
        for path in names[id(orig)]:
            parent_path, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent_path) if parent_path else model, leaf, new)
    _follow_ties(model, modules, plan, built, names)
    for mname, attr, local in plan.attrs:
        setattr(modules[mname], attr, local)
    params = dict(model.named_parameters())
    for pname in plan.grad_allreduce:
        params[pname].register_hook(_grad_allreduce_hook(group, pname))
    setattr(model, "ds_autotp_parsed", True)
    return plan
