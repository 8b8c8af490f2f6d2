"""DeepSpeed's UlyssesSPViTAttention (`deepspeed.sequence.autosp_vit`): sequence parallelism
around a ViT encoder's attention.

    attn = UlyssesSPViTAttention(vit_layer.attn, mesh.group("sequence"), has_cls_token=True)
    out = attn(hidden_states)     # [b, (1 +) local patches, h] -> the same shape

A ViT's attention is not causal (every patch sees every patch) and is opaque (it takes
hidden states, its q, k, v are inside), so it cannot be split by heads like
DistributedAttention: each rank gathers every rank's patches (seq_gather.py), runs the
wrapped attention on the whole image, and keeps the output of its own patches. What is
saved is the memory of everything outside attention (MLPs, norms), which stays per slice.

The [CLS] token, when there is one, is replicated: every rank puts its copy in front of the
gathered patches and gets the CLS output back. Ranks may hold different patch counts (5
over 2: 3 and 2); the wrapped attention always sees exactly the real patches.

Gradients: rank r's patches receive the sum over the group of every rank's gradient for
them (the gather's backward), and the CLS copy and the wrapped attention's parameters
receive this rank's share, which the engine's reduction over the sequence axis sums, as
for any replicated weight. DeepSpeed's wrapper gathers with a plain all_gather, so its
patches get no gradient at all: here they get the one-process gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..core import comm
from .seq_gather import gather_sequence, own_slice


class UlyssesSPViTAttention(nn.Module):
    """attn: the ViT attention (hidden_states, **kwargs) -> tensor, or a tuple/list whose
    first element is the output (the other elements are returned unchanged).
    process_group: the sequence group. has_cls_token: position 0 is a replicated [CLS]."""

    def __init__(self, attn: nn.Module, process_group, has_cls_token: bool = True) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.has_cls_token = bool(has_cls_token)

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        if hidden_states.dim() != 3:
            raise ValueError(f"UlyssesSPViTAttention: hidden_states has {hidden_states.dim()} dims; expected 3 "
                             "([batch, local sequence, hidden])")
        if self.has_cls_token and hidden_states.shape[1] < 1:
            raise ValueError("UlyssesSPViTAttention: has_cls_token=True but hidden_states holds no token")
        head = 1 if self.has_cls_token else 0
        patches, lengths = gather_sequence(hidden_states[:, head:], self.process_group)
        full = torch.cat([hidden_states[:, :head], patches], dim=1) if head else patches
        result = self.attn(full, **kwargs)
        if isinstance(result, (tuple, list)):
            if len(result) == 0:
                raise ValueError("UlyssesSPViTAttention: the wrapped attention returned an empty "
                                 f"{type(result).__name__}; expected the output first")
            out, extra = result[0], tuple(result[1:])
        else:
            out, extra = result, ()
        if out.dim() != 3 or out.shape[1] != full.shape[1]:
            raise ValueError(f"UlyssesSPViTAttention: the wrapped attention returned shape {tuple(out.shape)} for "
                             f"input {tuple(full.shape)}; expected [batch, {full.shape[1]}, hidden]")
        mine = own_slice(out[:, head:], lengths, self.process_group)
        local = torch.cat([out[:, :head], mine], dim=1) if head else mine
        # as DeepSpeed: a one-element tuple comes back as the bare tensor
        return (local, *extra) if extra else local
