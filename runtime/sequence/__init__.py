"""Ulysses sequence parallelism: each rank of a sequence group holds a slice of the sequence,
and all-to-alls trade it for a slice of the attention heads around the attention kernel.

    heads.py       which heads each rank attends over (pure): uneven head counts and
                   grouped-query attention, where the split follows the key/value heads
    all_to_all.py  the two exchanges (sequence slice -> head slice and back) as autograd
                   functions: each one's backward is the other, over the same named group
    layer.py       DistributedAttention, DeepSpeed's wrapper around a local attention
                   (also `deepspeed.sequence.layer` through the compatibility package)
    seq_gather.py  the whole sequence from uneven slices, with autograd (backward reduce-scatters)
    vit_attention.py  UlyssesSPViTAttention: a ViT's opaque attention over the gathered patches
    fusion.py      the multimodal fusion adapters: visual tokens gathered, spliced, re-sharded
    autowrap.py    AutoSP's class-name detection and auto_wrap_model_for_sp
                   (deepspeed.sequence.autosp_vit / autosp_fusion / autosp_detector / auto_sp)

The engine side (the `sequence` mesh axis, the batch rule counting data-parallel ranks
only, gradients averaged over data x sequence) lives in runtime/core/parallel/ and engine.py.
"""
from .all_to_all import heads_to_sequence, sequence_to_heads
from .autowrap import SPModelInfo, auto_wrap_model_for_sp, detect_model_sp_info
from .fusion import InternVLFusionAdapter, LlavaFusionAdapter, ModalityFusionSPAdapter, Qwen2VLFusionAdapter
from .heads import SequenceParallelError, head_splits
from .layer import DistributedAttention
from .vit_attention import UlyssesSPViTAttention

# DeepSpeed's `deepspeed.sequence` exports the AutoSP names at package level too
__all__ = ["DistributedAttention", "InternVLFusionAdapter", "LlavaFusionAdapter", "ModalityFusionSPAdapter",
           "Qwen2VLFusionAdapter", "SPModelInfo", "SequenceParallelError", "UlyssesSPViTAttention",
           "auto_wrap_model_for_sp", "detect_model_sp_info", "head_splits", "heads_to_sequence",
           "sequence_to_heads"]
