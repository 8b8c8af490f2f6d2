"""Ulysses sequence parallelism: each rank of a sequence group holds a slice of the sequence,
and all-to-alls trade it for a slice of the attention heads around the attention kernel.

    heads.py       which heads each rank attends over (pure): uneven head counts and
                   grouped-query attention, where the split follows the key/value heads
    all_to_all.py  the two exchanges (sequence slice -> head slice and back) as autograd
                   functions: each one's backward is the other, over the same named group
    layer.py       DistributedAttention, DeepSpeed's wrapper around a local attention
                   (also `deepspeed.sequence.layer` through the compatibility package)

The engine side (the `sequence` mesh axis, the batch rule counting data-parallel ranks
only, gradients averaged over data x sequence) lives in runtime/core/parallel/ and engine.py.
"""
from .all_to_all import heads_to_sequence, sequence_to_heads
from .heads import SequenceParallelError, head_splits
from .layer import DistributedAttention

__all__ = ["DistributedAttention", "SequenceParallelError", "head_splits", "heads_to_sequence",
           "sequence_to_heads"]
