"""Where a checkpointed segment's inputs wait for the backward pass.

- partition_activations: each floating-point input is flattened and every rank of the
  model-parallel group keeps only its 1/mp slice (the ranks hold the same activation, so
  together they hold it once); backward all-gathers it on that group.
- cpu_checkpointing: what is kept moves to host memory and comes back for the recompute.
- contiguous_memory_optimization: the kept slices are copied into one buffer per input
  position, number_checkpoints slots long, filled in forward order, so they do not
  fragment memory; the slots are reused once every open checkpoint ran its backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ...core import comm
from ...core.strict import ConfigError


@dataclass
class Saved:
    """One input as kept: `data` (what is stored), and how to rebuild the original."""

    data: torch.Tensor
    shape: torch.Size
    device: torch.device
    dtype: torch.dtype
    partitioned: bool


class ContiguousSlots:
    """number_checkpoints slots per input position, reused after every open checkpoint
    has run its backward."""

    def __init__(self, slots: int):
        self.slots = slots
        self.buffers: Dict[int, torch.Tensor] = {}
        self.used = 0
        self.open = 0

    def take(self, position: int, piece: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(position)
        if buf is None or buf.shape[1] != piece.numel() or buf.dtype != piece.dtype or buf.device != piece.device:
            if buf is not None and self.open:
                raise ConfigError("activation_checkpointing.contiguous_memory_optimization: checkpointed inputs "
                                  f"differ in size ({buf.shape[1]} vs {piece.numel()} elements at input "
                                  f"{position}); it needs every checkpoint's inputs to have the same shapes")
            buf = torch.empty(self.slots, piece.numel(), dtype=piece.dtype, device=piece.device)
            self.buffers[position] = buf
        if self.used >= self.slots:
            raise ConfigError(f"activation_checkpointing.number_checkpoints: more than {self.slots} checkpoints are "
                              f"open in one forward; raise it")
        out = buf[self.used]
        out.copy_(piece.reshape(-1))
        return out

    def opened(self) -> None:
        self.used += 1
        self.open += 1

    def closed(self) -> None:
        self.open -= 1
        if self.open <= 0:
            self.open = 0
            self.used = 0

    def clear(self) -> None:
        self.buffers.clear()
        self.used = self.open = 0


def _partition(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    per = -(-flat.numel() // size)
    piece = flat[rank * per:(rank + 1) * per]
    if piece.numel() < per:
        piece = torch.cat([piece, piece.new_zeros(per - piece.numel())])
    return piece.clone()


def keep(tensors: List[Optional[torch.Tensor]], settings, slots: Optional[ContiguousSlots]) -> List[Optional[Saved]]:
    """Turn the segment's tensor inputs into what waits for backward (None for non-tensors)."""
    out: List[Optional[Saved]] = []
    group, size, rank = settings.mp_group, settings.mp_size, settings.mp_rank
    for pos, t in enumerate(tensors):
        if t is None:
            out.append(None)
            continue
        split = settings.partition_activations and size > 1 and t.is_floating_point() and t.numel() >= size
        data = _partition(t, rank, size) if split else t.detach()
        if slots is not None and split:
            data = slots.take(pos, data)
        if settings.cpu_checkpointing and data.device.type != "cpu":
            data = data.to("cpu", non_blocking=False)
        out.append(Saved(data, t.shape, t.device, t.dtype, split))
    if slots is not None:
        slots.opened()
    return out


def restore(saved: List[Optional[Saved]], originals_requires_grad: List[bool],
            settings) -> List[Optional[torch.Tensor]]:
    """Rebuild the inputs for the recompute: gather the slices, bring them back to their device."""
    out: List[Optional[torch.Tensor]] = []
    for s, needs_grad in zip(saved, originals_requires_grad):
        if s is None:
            out.append(None)
            continue
        data = s.data.to(s.device) if s.data.device != s.device else s.data
        if s.partitioned:
            full = torch.empty(data.numel() * settings.mp_size, dtype=data.dtype, device=data.device)
            comm.all_gather_into_tensor(full, data.contiguous(), group=settings.mp_group,
                                        label="activation checkpoint partitions")
            n = 1
            for d in s.shape:
                n *= d
            data = full[:n].view(s.shape)
        t = data.detach()
        t.requires_grad_(needs_grad)
        out.append(t)
    return out


def split_tensors(args: Tuple) -> Tuple[List[Optional[torch.Tensor]], List]:
    """(tensors with None where the argument is not a tensor, the non-tensor arguments)."""
    return [a if isinstance(a, torch.Tensor) else None for a in args], \
        [None if isinstance(a, torch.Tensor) else a for a in args]


def merge(tensors: List[Optional[torch.Tensor]], others: List) -> Tuple:
    return tuple(t if t is not None else o for t, o in zip(tensors, others))
