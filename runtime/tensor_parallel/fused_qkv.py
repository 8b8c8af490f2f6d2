"""How DeepSpeed's AutoTP cuts a fused projection (`deepspeed.module_inject.fusedqkv_utils`
and the layers `fused_LinearLayer` / `GateUpPack_LinearLayer`): the weight's output rows are a
few sub-parameters stacked (q, k, v; or gate, up), each split over the tensor-parallel ranks on
its own, and a rank keeps its piece of every sub-parameter, concatenated in order.

Pure logic, no process group: which fused layout a block has, the sub-parameter sizes of that
layout, and every rank's width of each sub-parameter (tp_shard's sizes, so kv-head and grain
aware, uneven allowed); and the sub-parameters a layer spec's `shape` names.

The layout is read, as DeepSpeed does, from the block's printed form: the longest known block
class name that appears in it (a GLM block prints "GLMBlock"; an unknown block is read as
Bloom's single stacked block). CodeGen (blocks interleaved across ranks) and GPTBigCode (the kv
block kept whole on every rank) are not per-sub-parameter splits: `subparam_sizes` answers None
for them and the layers refuse to cut or gather them.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from .tp_shard import AutoTPMeta, get_shard_size_list

# Block class name -> fused layout, as DeepSpeed's table names them.
FUSED_QKV_TYPES = {
    "CodeGenBlock": "codegentype", "BloomBlock": "bloomtype", "GLMBlock": "glmtype", "MPTBlock": "glmtype",
    "MptBlock": "glmtype", "BaichuanLayer": "glmtype", "QWenBlock": "qwentype", "FalconDecoderLayer": "bloomtype",
    "GPTBigCodeBlock": "bigcodetype", "DecoderLayer": "glmtype", "Phi3DecoderLayer": "phi3type",
}
# The layouts that are not one split per sub-parameter (see the module docstring).
UNSPLITTABLE = ("codegentype", "bigcodetype")


def fused_qkv_type(block: Any) -> Optional[str]:
    """The fused layout of `block`, or None when no known block name appears in its printed form."""
    text = str(block).strip()
    found = [name for name in FUSED_QKV_TYPES if name in text]
    # "FalconDecoderLayer" also contains "DecoderLayer": the longest name is the block's own
    return FUSED_QKV_TYPES[max(found, key=len)] if found else None


def subparam_sizes(block: Any, weight_shape: Sequence[int], meta: AutoTPMeta) -> Optional[Tuple[int, ...]]:
    """The sizes of the sub-parameters stacked in a fused qkv weight [out, in], or None for the
    layouts that are not split per sub-parameter."""
    kind = fused_qkv_type(block) or "bloomtype"  # DeepSpeed reads an unknown block as Bloom's
    total = int(weight_shape[0])
    if kind == "bloomtype":
        return (total,)
    if kind in ("glmtype", "qwentype"):
        if meta.num_kv_heads == 2:  # ChatGLM2/3: a wide q, then two narrow k and v
            if meta.n_embd is None:
                raise ValueError("fused qkv: the GLM layout with 2 kv heads needs the model's hidden size (n_embd)")
            kv = (total - meta.n_embd) // 2
            return (meta.n_embd, kv, kv)
        return (total // 3,) * 3
    if kind == "phi3type":
        if not meta.num_attention_heads or meta.num_kv_heads is None:
            raise ValueError("fused qkv: the Phi-3 layout needs the model's attention and kv head counts")
        kv = meta.num_kv_heads * (int(weight_shape[1]) // meta.num_attention_heads)
        return (total - 2 * kv, kv, kv)
    return None


def subparam_widths(sizes: Sequence[int], tp: int, meta: AutoTPMeta, name: Optional[str]) -> List[List[int]]:
    """Every rank's width of each sub-parameter: one list (in rank order) per sub-parameter.
    A rank may get 0 of a narrow sub-parameter (fewer heads than ranks), as in DeepSpeed."""
    return [list(get_shard_size_list(size, tp, meta, name)) for size in sizes]


def rank_rows(widths: Sequence[Sequence[int]], rank: int) -> List[Tuple[int, int]]:
    """The [start, stop) row ranges of the fused weight that `rank` keeps, in its block's order."""
    out, offset = [], 0
    for per_rank in widths:
        start = offset + sum(per_rank[:rank])
        out.append((start, start + per_rank[rank]))
        offset += sum(per_rank)
    return out


def qwen_split_size(widths: Sequence[Sequence[int]], rank: int) -> int:
    """The query width QWen must unpack its fused output with on `rank` (attn.split_size)."""
    width = widths[0][rank]
    if width == 0:
        # QWen splits its output by split_size into q, k, v: a width of 0 cannot give three
        raise RuntimeError(f"AutoTP cannot split this QWen attention over {len(widths[0])} ranks: rank {rank} "
                           f"would hold an empty query/key/value shard; use a smaller tensor parallel size")
    return width


def _as_tuple(spec: Any) -> Any:
    return tuple(_as_tuple(v) for v in spec) if isinstance(spec, (list, tuple)) else spec


def shape_subparam_sizes(weight_shape: Sequence[int], shape: Any, partition_dim: int,
                         name: Optional[str]) -> Optional[Tuple[int, ...]]:
    """The sub-parameter sizes a layer spec's `shape` gives the weight [out, in] along
    `partition_dim` (DeepSpeed's SubParamLinearLayer / SubParamLinearAllreduce views):

        (n, -1)  / (-1, n)           n equal sub-parameters
        ((a, b, c), -1) / (-1, (a, b, c))  sub-parameters of those sizes
        -1 at partition_dim          None: one block, split plainly

    Only a 2-D view splitting the weight's own dimension is provided; a deeper view (heads x
    head_dim x in) is refused with the reason, as is any size that does not fit the weight."""
    label = f"AutoTP layer '{name}'" if name else "AutoTP layer"
    shape = _as_tuple(shape)
    if not isinstance(shape, tuple) or len(shape) != 2 or partition_dim not in (0, 1):
        raise ValueError(f"{label}: only a 2-D shape split along dim 0 or 1 is provided here, not shape={shape!r} "
                         f"with partition_dim={partition_dim}")
    other = shape[1 - partition_dim]
    if other != -1 and other != weight_shape[1 - partition_dim]:
        raise ValueError(f"{label}: shape {shape!r} does not fit the weight {tuple(weight_shape)}")
    size, spec = int(weight_shape[partition_dim]), shape[partition_dim]
    if isinstance(spec, tuple):
        if not spec or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in spec):
            raise ValueError(f"{label}: sub-parameter sizes must be positive integers, not {spec!r}")
        if sum(spec) != size:
            raise ValueError(f"{label}: sub-parameter sizes {spec!r} sum to {sum(spec)}, not the weight's {size}")
        return spec
    if not isinstance(spec, int) or isinstance(spec, bool) or (spec <= 0 and spec != -1):
        raise ValueError(f"{label}: the partition dim's spec must be a positive integer, -1 or a tuple, not {spec!r}")
    if spec == -1:
        return None
    if size % spec:
        raise ValueError(f"{label}: the weight's {size} does not split into {spec} equal sub-parameters")
    return (size // spec,) * spec
