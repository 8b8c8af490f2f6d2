"""Muon's per-matrix maths: Nesterov momentum, then Newton-Schulz orthogonalisation.

Everything here works on batches: `orthogonalize(updates)` takes any number of matrices,
groups those of one shape, and runs each group's Newton-Schulz iteration as one stack of
batched matmuls (B x n x m), instead of one small matmul chain per parameter. The
iteration normalises each matrix by its own Frobenius norm, so stacking changes nothing
but the speed.

The numbers are DeepSpeed 0.19.8's (its `muon_update`):
  momentum  m <- lerp(m, g, 1 - beta)                  (kept when g has a non-finite entry)
  update    u  = lerp(g, m, beta)                      (Nesterov)
  u <- NS5(u) * sqrt(max(1, rows / cols))              (5 quintic steps, a, b, c below)
and `ns_method` picks the iteration: "standard" iterates on X (n x m), "gram" on the
n x n Gram matrix X X^T with a restart at step 2 (the same polynomial, fewer flops when
m >> n; a square matrix takes the standard path). Each runs in the dtype DeepSpeed picks
for the device (`compute_dtype`): gram in fp16 where fp16 matmuls are supported (CUDA at
compute capability 7 and up; a CPU with AVX512-FP16), standard in bf16 (CUDA with bf16,
every CPU), else fp32. On this project's CPU test machines that makes gram fp32, which is
why losses there equal DeepSpeed's to fp32 rounding.

Shapes: a 4-D weight (a convolution's filters) is orthogonalised as rows x (the rest); a
3-D or higher tensor otherwise as a batch of its last two dimensions. The aspect factor is
taken from the last two dimensions of the weight as it is shaped, as DeepSpeed takes it.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, Sequence, Tuple

import torch

# The quintic's coefficients (Keller Jordan's Muon): steepest slope at zero that still keeps
# the singular values within about [0.7, 1.2] after five steps.
A, B, C = 3.4445, -4.7750, 2.0315
NS_STEPS = 5
NS_METHODS = ("gram", "standard")
_EPS = 1e-7  # added to the Frobenius norm before dividing by it
_GRAM_RESTART = 2  # the gram iteration rebuilds X and its Gram matrix before this step


def _cpu_fp16_matmul() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _cuda_fp16(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")


def compute_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in on `device`, as DeepSpeed's accelerators answer it."""
    if method == "gram":
        fp16 = _cuda_fp16(device) if device.type == "cuda" else _cpu_fp16_matmul()
        return torch.float16 if fp16 else torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16


def aspect_scale(shape: Sequence[int]) -> float:
    rows, cols = shape[-2], shape[-1]
    return math.sqrt(rows / cols) if rows > cols else 1.0


def matrix_view_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape Newton-Schulz sees for a weight of `shape` (leading dimensions are a batch)."""
    if len(shape) == 4:
        return (shape[0], math.prod(shape[1:]))
    return tuple(shape)


def _standard(X: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        gram = X @ X.mT
        poly = B * gram + C * gram @ gram
        X = A * X + poly @ X
    return X


def _gram(X: torch.Tensor, steps: int) -> torch.Tensor:
    """X_{k+1} = (aI + Z_k) X_k with Z_k = b R_k + c R_k^2 and R_k = X_k X_k^T: the product
    of the (aI + Z_k) is accumulated in Q and applied to X once at the end, and R is carried
    forward as (aI + Z) R (aI + Z) instead of being recomputed from X, except at the restart,
    which rebuilds X = Q X and R from it to shed the rounding the small-dtype recurrence gathers."""
    R = X @ X.mT
    Q = None
    for i in range(steps):
        if i == _GRAM_RESTART:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = B * R + C * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(A)
        else:
            Q = A * Q + Z @ Q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            RZ = A * R + Z @ R
            R = A * RZ + Z @ RZ
    return Q @ X


def newton_schulz(G: torch.Tensor, method: str = "gram", steps: int = NS_STEPS) -> torch.Tensor:
    """Orthogonalise a batch of matrices G (..., rows, cols); returns the compute dtype."""
    dtype = compute_dtype(method, G.device)
    wide = G.size(-2) > G.size(-1)  # iterate on the short side: X X^T is then the small product
    if method == "gram":
        # normalised before the cast: an fp32 value beyond fp16's range would otherwise arrive
        # as inf and zero the whole matrix
        X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
        if wide:
            X = X.mT
        X = (X / (X.norm(dim=(-2, -1), keepdim=True) + _EPS)).to(dtype)
        X = _standard(X, steps) if X.size(-1) <= X.size(-2) else _gram(X, steps)
    else:
        X = G.to(dtype)
        if wide:
            X = X.mT
        X = _standard(X / (X.norm(dim=(-2, -1), keepdim=True) + _EPS), steps)
    return X.mT if wide else X


def nesterov_(grad: torch.Tensor, momentum: torch.Tensor, beta: float) -> torch.Tensor:
    """Fold `grad` into `momentum` in place and return the Nesterov blend (a new tensor).
    Elementwise, so it runs on a whole flat partition at once (ZeRO) or on whole matrices."""
    momentum.lerp_(grad, 1 - beta)
    return torch.lerp(grad, momentum, beta)


def orthogonalize(updates: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], method: str,
                  out_dtype: torch.dtype) -> List[torch.Tensor]:
    """NS(u) * aspect for each update u (any layout with the weight's element count; shaped
    by `shapes`), returned flat in `out_dtype`. Updates whose matrix view has the same
    (rows, cols) go through one batched iteration."""
    by_shape: Dict[Tuple[int, int], List[int]] = {}
    views = []
    for i, (u, shape) in enumerate(zip(updates, shapes)):
        view = matrix_view_shape(shape)
        views.append(view)
        by_shape.setdefault(tuple(view[-2:]), []).append(i)
    out: List[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
    for (rows, cols), idx in by_shape.items():
        # each update contributes its count of (rows x cols) matrices: a 2-D weight one, a
        # stacked [experts, rows, cols] weight one per expert; concatenated along that count
        parts = [updates[i].reshape(-1, rows, cols) for i in idx]
        batch = torch.cat(parts) if len(parts) > 1 else parts[0]
        result = newton_schulz(batch, method)
        at = 0
        for i, part in zip(idx, parts):
            n = part.size(0)
            out[i] = (result[at:at + n].reshape(-1) * aspect_scale(shapes[i])).to(out_dtype)
            at += n
    return out


def finite_rows(matrices: torch.Tensor) -> torch.Tensor:
    """Per matrix of a (B, ...) stack: whether every entry is finite."""
    return torch.isfinite(matrices.reshape(matrices.size(0), -1)).all(dim=1)
