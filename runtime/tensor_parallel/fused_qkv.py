"""How DeepSpeed's AutoTP cuts a fused projection (`deepspeed.module_inject.fusedqkv_utils`
and the layers `fused_LinearLayer` / `GateUpPack_LinearLayer`): the weight's output rows are a
few sub-parameters stacked (q, k, v; or gate, up), each split over the tensor-parallel ranks on
its own, and a rank keeps its piece of every sub-parameter, concatenated in order.

Pure logic, no process group: which fused layout a block has, the sub-parameter sizes of that
layout, and the query width QWen unpacks with. The per-rank widths and the cuts are
subparams.py's (the same maths as every other sub-parameter layer).

The layout is read, as DeepSpeed does, from the block's printed form: the longest known block
class name that appears in it (a GLM block prints "GLMBlock"; an unknown block is read as
Bloom's single stacked block). CodeGen (blocks interleaved across ranks) and GPTBigCode (the kv
block kept whole on every rank) are not per-sub-parameter splits: `subparam_sizes` answers None
for them and the layers refuse to cut or gather them
(autotp_subparam_layers.fused_LinearLayer).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

from .tp_shard import AutoTPMeta

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


def qwen_split_size(widths: Sequence[Sequence[int]], rank: int) -> int:
    """The query width QWen must unpack its fused output with on `rank` (attn.split_size)."""
    width = widths[0][rank]
    if width == 0:
        # QWen splits its output by split_size into q, k, v: a width of 0 cannot give three
        raise RuntimeError(f"AutoTP cannot split this QWen attention over {len(widths[0])} ranks: rank {rank} "
                           f"would hold an empty query/key/value shard; use a smaller tensor parallel size")
    return width
