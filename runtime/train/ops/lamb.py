"""`deepspeed.ops.lamb`: FusedLamb, DeepSpeed's LAMB maths on any device (torch ops)."""
from __future__ import annotations

from dslaunch.kernels.lamb import Lamb

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    """LAMB with DeepSpeed's FusedLamb signature and formula (see dslaunch.kernels.lamb);
    implemented with torch ops, not a CUDA kernel. max_grad_norm > 0 is refused: clip with
    the config's gradient_clipping."""
