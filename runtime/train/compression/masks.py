"""The compression techniques as torch parametrizations (torch.nn.utils.parametrize).

Each technique is a small module registered on a layer's `weight` (and `bias` for rows):
forward sees the masked / fake-quantized tensor, the optimizer updates the original. Masks,
scores, the pruning steps done and the bit width are buffers or parameters of the
parametrization, so they are in the model's state_dict: a checkpoint resumes with its masks.

Every mask keeps the entries ranked first by `keep_top`: l1 ranks magnitudes (single weights)
or row / channel L1 norms, topk ranks learnt scores (DeepSpeed's movement-pruning variant),
which get the mask's gradient straight through. Weight quantization uses
fake quantization (DeepSpeed's grids) on groups of whole rows with a straight-through gradient
(DeepSpeed passes the gradient unchanged, clipped values included). They are applied in
DeepSpeed's order: quantize, then sparse, row and head masks.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def keep_count(ratio: float, n: int) -> int:
    """How many of n entries a dense ratio keeps (DeepSpeed's rule: ceil(ratio * n), at least one)."""
    return min(n, max(1, math.ceil(ratio * n)))


def keep_top(values: torch.Tensor, ratio: float) -> torch.Tensor:
    """1 for the keep_count(ratio, n) largest values, else 0, in values' shape and dtype.

    The ranking is torch's default (not stable) descending sort of the flattened values, the
    call DeepSpeed 0.17.6's TopKBinarizer made: equal values (zero weights, rows of equal
    norm) are then kept or pruned as in DeepSpeed. torch.topk and a stable sort break such
    ties differently (on the CPU, for more than 16 values)."""
    flat = values.detach().flatten()
    order = flat.sort(descending=True).indices
    mask = torch.zeros_like(flat)
    mask[order[:keep_count(ratio, flat.numel())]] = 1.0
    return mask.view_as(values)


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """keep_top of the scores; gradient to the scores unchanged (straight through)."""
    return keep_top(scores, ratio) + (scores - scores.detach())


def _scores(shape) -> nn.Parameter:
    scores = nn.Parameter(torch.empty(shape))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


class _Technique(nn.Module):
    """State shared by the pruning techniques: the dense ratio of each pruning step
    (`ratios`, from the config) and how many of them are done (`done`, an integer buffer, so
    that it survives checkpoints and model.to(dtype)); done == 0 means not pruning yet.

    l1 with one pruning step ranks the weights as init_compression finds them (`rank_now`),
    as DeepSpeed 0.17.6 did: its layers computed the l1 mask when the technique was enabled on
    them, and its scheduler only switched the mask on at schedule_offset. The steps of a
    gradual (sparse) schedule rank the weights as they are at each step."""

    method = "topk"

    def __init__(self, ratios):
        super().__init__()
        self.ratios = [float(r) for r in ratios]
        self.register_buffer("done", torch.tensor(0, dtype=torch.int64))

    @property
    def ranked_at_init(self) -> bool:
        return self.method == "l1" and len(self.ratios) == 1

    def is_active(self) -> bool:
        return int(self.done) > 0

    @property
    def ratio(self) -> float:
        return self.ratios[int(self.done) - 1] if self.is_active() else 1.0

    def rank_now(self, weight: torch.Tensor) -> None:
        """Rank the weight for the (only) pruning step without applying the mask yet."""
        self._update_mask(weight.detach(), self.ratios[0])

    def prune_to(self, weight: torch.Tensor, done: int) -> None:
        """Take pruning steps up to `done`; unless the mask was ranked at init, rank `weight`
        as it is now (pruned entries stay pruned: the caller passes the weight with this
        technique's current mask applied)."""
        self.done.fill_(done)
        if not self.ranked_at_init:
            self._update_mask(weight.detach(), self.ratio)

    def _update_mask(self, weight: torch.Tensor, ratio: float) -> None:  # l1 ranks; topk reads scores
        pass


class SparseMask(_Technique):
    """Unstructured pruning of a whole weight (Linear or Conv2d)."""

    kind = "sparse"

    def __init__(self, weight: torch.Tensor, method: str, ratios):
        super().__init__(ratios)
        self.method = method
        self.register_buffer("mask", torch.ones_like(weight, dtype=weight.dtype))
        if method == "topk":
            self.scores = _scores(weight.shape)

    def current(self) -> torch.Tensor:
        if self.method == "topk":
            return topk_mask(self.scores, self.ratio)
        return self.mask

    def _update_mask(self, weight: torch.Tensor, ratio: float) -> None:
        if self.method == "l1":
            self.mask.copy_(keep_top(weight.abs(), ratio))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.current().to(w.dtype) if self.is_active() else w


class RowMask(_Technique):
    """Output rows of a Linear weight (output channels of a Conv2d: ChannelMask); `RowBias`
    applies the same mask to the bias."""

    kind = "row"

    def __init__(self, weight: torch.Tensor, method: str, ratios):
        super().__init__(ratios)
        self.method = method
        shape = (weight.shape[0],) + (1,) * (weight.dim() - 1)
        self.register_buffer("mask", torch.ones(shape, dtype=weight.dtype))
        if method == "topk":
            self.scores = _scores(shape)

    def current(self) -> torch.Tensor:
        if self.method == "topk":
            return topk_mask(self.scores, self.ratio)
        return self.mask

    def _update_mask(self, weight: torch.Tensor, ratio: float) -> None:
        if self.method == "l1":
            # the L1 norm of each row (of each output channel's kernels), by DeepSpeed's call for a Linear
            norms = torch.linalg.vector_norm(weight, ord=1, dim=tuple(range(1, weight.dim())))
            self.mask.copy_(keep_top(norms, ratio).view(self.mask.shape))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.current().to(w.dtype) if self.is_active() else w


class ChannelMask(RowMask):
    """Output channels of a Conv2d weight."""

    kind = "channel"


class RowBias(nn.Module):
    """The bias rows of a row-pruned Linear; reads the weight's RowMask (not a child of it, so
    the mask is stored once)."""

    def __init__(self, rows: RowMask):
        super().__init__()
        self._rows = [rows]

    def forward(self, b: torch.Tensor) -> torch.Tensor:
        rows = self._rows[0]
        return b * rows.current().view(-1).to(b.dtype) if rows.is_active() else b


class HeadMask(_Technique):
    """Attention heads on the output projection: its input columns in num_heads equal blocks."""

    kind = "head"

    def __init__(self, weight: torch.Tensor, num_heads: int, ratios):
        super().__init__(ratios)
        self.num_heads = num_heads
        self.scores = _scores((1, num_heads))

    def current(self) -> torch.Tensor:
        return topk_mask(self.scores, self.ratio)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.is_active():
            return w
        out = w.shape[0]
        mask = self.current().to(w.dtype).view(1, self.num_heads, 1)
        return (w.reshape(out, self.num_heads, -1) * mask).reshape(w.shape)


def fake_quantize(w: torch.Tensor, bits: int, groups: int, symmetric: bool, low=None, high=None) -> torch.Tensor:
    """w rounded to `bits` bits, one scale per group of whole rows (DeepSpeed's Sym/AsymQuantizer
    values). The range of each group is its own min and max unless `low` / `high` (one value,
    static calibration) are given. Symmetric: torch.fake_quantize_per_channel_affine (zero point
    0). Asymmetric: the grid starts at the multiple of the scale nearest the minimum, wherever
    that is, as DeepSpeed's AsymQuantizer; torch's fake-quant op would clamp the zero point into
    [0, 2^bits - 1], which moves the grid of a group whose values are all positive (inputs after
    a ReLU) or all negative."""
    levels = 2 ** bits
    x = w.detach().float().reshape(groups, -1)
    if low is None:
        low, high = x.amin(dim=1), x.amax(dim=1)
    else:
        low, high = low.float().reshape(1), high.float().reshape(1)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scale = (2 * torch.maximum(low.abs(), high) / levels).clamp_min(tiny)
        zero = torch.zeros(groups, dtype=torch.int32, device=x.device)
        q = torch.fake_quantize_per_channel_affine(x, scale, zero, 0, -levels // 2, levels // 2 - 1)
    else:
        scale = ((high - low) / levels).clamp_min(tiny).reshape(-1, 1)
        start = (low.reshape(-1, 1) / scale).round() * scale  # the grid's first value
        q = ((x - start) / scale).round().clamp(0, levels - 1) * scale + start
    return q.reshape(w.shape).to(w.dtype)


class WeightQuant(nn.Module):
    """Fake-quantized weight in forward; bits fall from start_bits to target_bits, one bit every
    quantization_period steps from schedule_offset."""

    kind = "quant"

    def __init__(self, weight: torch.Tensor, groups: int, symmetric: bool):
        super().__init__()
        self.groups = groups
        self.symmetric = symmetric
        self.register_buffer("bits", torch.tensor(0, dtype=torch.int64))  # 0: not quantizing yet

    def is_active(self) -> bool:
        return int(self.bits) > 0

    def set_bits(self, bits: int) -> None:
        self.bits.fill_(bits)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if not self.is_active():
            return w
        q = fake_quantize(w, int(self.bits), self.groups, self.symmetric)
        return w + (q - w).detach()


class ActivationQuant(nn.Module):
    """Fake-quantized inputs of a Linear or Conv2d (a forward pre-hook), straight-through
    gradient. dynamic: each token (Linear) or sample (Conv2d) its own range; static: one range,
    a moving average (momentum 0.95) of the training batches' min and max, as DeepSpeed's
    QuantAct."""

    def __init__(self, bits: int, symmetric: bool, static: bool, conv: bool, momentum: float = 0.95):
        super().__init__()
        self.num_bits, self.symmetric, self.static, self.conv, self.momentum = bits, symmetric, static, conv, momentum
        self.register_buffer("active", torch.tensor(False))
        if static:
            self.register_buffer("x_min_max", torch.zeros(2))

    def is_active(self) -> bool:
        return bool(self.active)

    def hook(self, module: nn.Module, args):
        if not self.is_active():
            return None
        x = args[0]
        if self.static:
            if self.training:
                with torch.no_grad():
                    low, high = x.detach().min().to(self.x_min_max.dtype), x.detach().max().to(self.x_min_max.dtype)
                    if self.x_min_max[0] == self.x_min_max[1]:
                        self.x_min_max[0], self.x_min_max[1] = low, high
                    m = self.momentum
                    self.x_min_max[0] = self.x_min_max[0] * m + low * (1 - m)
                    self.x_min_max[1] = self.x_min_max[1] * m + high * (1 - m)
            q = fake_quantize(x, self.num_bits, 1, self.symmetric, self.x_min_max[0], self.x_min_max[1])
        else:
            groups = x.shape[0] if self.conv else x.numel() // x.shape[-1]
            q = fake_quantize(x, self.num_bits, groups, self.symmetric)
        return (x + (q - x).detach(),) + tuple(args[1:])
