"""Rotary position embedding applied to a tensor, as DeepSpeed's sequence-parallel layers apply it
(`deepspeed.sequence.layer.apply_rotary_pos_emb(t, cos, sin)`).

The last dimension's first `rot_dim` features (rot_dim = the width of the cos/sin tables) are
rotated pairwise, the feature i of the first half with the feature i of the second half:
t * cos + rotate_half(t) * sin, where rotate_half swaps the halves and negates the new first
half; features beyond rot_dim pass through. Plain torch ops (DeepSpeed takes a fused kernel
from the optional torchembed package when it is installed and the tensor is on a GPU; the
result is the same, so `_torchembed_available` is False here).
"""
from __future__ import annotations

import torch

_torchembed_available = False


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] -> [-b, a] over the last dimension's two halves."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary_pos_emb(t: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    rot_dim = freqs_cos.shape[-1]
    rotated, rest = t[..., :rot_dim], t[..., rot_dim:]
    rotated = rotated * freqs_cos + _rotate_half(rotated) * freqs_sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


__all__ = ["apply_rotary_pos_emb"]
