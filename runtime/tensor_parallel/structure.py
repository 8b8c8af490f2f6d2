"""Read-only inspection of a model's module tree: blocks, linear layers, norms, embeddings.

Automatic tensor parallelism works from structure rather than from a table of model classes:
the repeated transformer blocks are the elements of an nn.ModuleList; inside a block the
projections are nn.Linear or Hugging Face's Conv1D (recognised by duck typing, so transformers
is never imported here); norms are LayerNorm/RMSNorm-like modules. Nothing here modifies the
model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .shard import linear_shape  # noqa: F401  (re-exported: surgery, plan)


@dataclass(frozen=True)
class LinearInfo:
    """A projection inside a block, in registration order."""

    name: str  # qualified name in the model
    rel: str  # name relative to its block
    in_features: int
    out_features: int
    conv1d: bool  # Hugging Face Conv1D: weight stored [in, out], y = x @ W + b
    has_bias: bool


@dataclass(frozen=True)
class Block:
    name: str
    cls: type
    module: nn.Module


def norm_width(module: nn.Module) -> Optional[int]:
    """The normalised width of a LayerNorm/RMSNorm-like module, else None."""
    if isinstance(module, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))):
        shape = module.normalized_shape
        return shape[-1] if shape else None
    name = type(module).__name__
    if name.endswith(("LayerNorm", "RMSNorm", "Norm")) and not any(True for _ in module.children()):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1:
            return weight.shape[0]
    return None


def find_blocks(model: nn.Module) -> List[Block]:
    """The elements of every outermost nn.ModuleList that hold at least two projections."""
    blocks: List[Block] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList):
                for idx, elem in child.named_children():
                    if sum(1 for m in elem.modules() if linear_shape(m)) >= 2:
                        blocks.append(Block(f"{qual}.{idx}", type(elem), elem))
                    else:
                        walk(elem, f"{qual}.{idx}.")
            else:
                walk(child, qual + ".")

    walk(model, "")
    return blocks


def block_items(block: Block) -> List[Tuple[str, nn.Module]]:
    """(relative name, module) for every submodule of a block in registration order."""
    return [(rel, m) for rel, m in block.module.named_modules() if rel]


def block_linears(block: Block) -> List[LinearInfo]:
    out = []
    for rel, m in block_items(block):
        shape = linear_shape(m)
        if shape:
            bias = getattr(m, "bias", None)
            out.append(LinearInfo(f"{block.name}.{rel}", rel, shape[0], shape[1], shape[2], bias is not None))
    return out


def parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def module_names(model: nn.Module) -> Dict[int, List[str]]:
    """Every name under which each module object is reachable (shared modules have several)."""
    names: Dict[int, List[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    return names


def _call(model: nn.Module, method: str) -> Optional[nn.Module]:
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError, TypeError):
        return None


def token_embedding(model: nn.Module, blocks: List[Block]) -> Optional[nn.Embedding]:
    """The token embedding: Hugging Face's get_input_embeddings(), else the largest embedding
    outside the blocks."""
    emb = _call(model, "get_input_embeddings")
    if isinstance(emb, nn.Embedding):
        return emb
    inside = {id(m) for b in blocks for m in b.module.modules()}
    found = [m for m in model.modules() if isinstance(m, nn.Embedding) and id(m) not in inside]
    return max(found, key=lambda m: m.num_embeddings, default=None)


def lm_head(model: nn.Module, blocks: List[Block], embedding: Optional[nn.Embedding]) -> Optional[nn.Linear]:
    """The output projection over the vocabulary: get_output_embeddings(), else the last Linear
    outside the blocks whose output width is the token embedding's row count."""
    head = _call(model, "get_output_embeddings")
    if isinstance(head, nn.Linear):
        return head
    if embedding is None:
        return None
    inside = {id(m) for b in blocks for m in b.module.modules()}
    found = [m for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in inside
             and m.out_features == embedding.num_embeddings]
    return found[-1] if found else None
