"""Tiled compute over the sequence, for sequences too long to hold a layer's activations at once,
under DeepSpeed's names (`deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`, ...).

    out = TiledMLP.apply(mlp_forward, mlp, x, shards, compute_params)          # x: [..., s, h]
    out = sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass,
                                 grad_requiring_tensor_key, compute_params, 1, None)
    loss = TiledFusedLogitsLoss.apply(loss_fn, lm_head, x, y, mask, shards, compute_params, "sum")
    loss = tiled_causal_lm_loss(hidden_states, lm_head, shards, shift_labels=..., group=sp_group)

Why tiles: a per-token function (an MLP, the LM head + cross-entropy) over s tokens keeps its
intermediate activations for backward ([s, 4h] for an MLP, [s, vocab] logits for the loss). Run
over one slice of the sequence at a time, without a graph, and recomputed slice by slice in
backward, only one slice's intermediates are ever alive; the price is a second forward of the
function (the loss avoids it: see below).

How gradients reach the weights: each call takes the trainable tensors the function uses (the
`compute_params` given, plus the parameters of `self` when it is a module) as inputs of the
autograd function, sums their gradients over the slices itself and returns them once. So every
weight's gradient is accumulated once per backward, as with the untiled function, and the
engine's gradient hooks (bucketed reduction, ZeRO) see nothing new; DeepSpeed instead accumulates
slice by slice and flags the weights `ds_grad_is_ready` for its ZeRO, which is set here too for
code that reads it. A trainable tensor the function uses but was not given is refused in one
line rather than left without its gradient.

The loss runs its backward inside forward (the logits of a slice are freed at once, and nothing
is recomputed) and keeps the gradients until backward, which scales them by the incoming
gradient: a loss divided for gradient accumulation or multiplied by a loss scale gets its weight
gradients scaled too (DeepSpeed 0.19.8 scales only the input's gradient).

`TiledFusedLogitsLoss`'s "mean" is the mean of the slices' losses, which is the mean over tokens
only when every slice holds as many labelled tokens; `tiled_causal_lm_loss` is the mean over the
labelled tokens of the whole sequence (and over a Ulysses group's slices, given the group).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch


# -- shared plumbing --------------------------------------------------------------------------
def _trainable(self_module, compute_params) -> List[torch.Tensor]:
    """The weights a tiled function differentiates: compute_params, then self's parameters,
    each once, those that require grad."""
    out, seen = [], set()
    more = list(self_module.parameters()) if isinstance(self_module, torch.nn.Module) else []
    for p in list(compute_params or []) + more:
        if torch.is_tensor(p) and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _leaves(output: torch.Tensor) -> List[torch.Tensor]:
    """The leaf tensors requiring grad that `output`'s graph reaches."""
    found, seen, todo = [], set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad
        if var is not None:
            found.append(var)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _check_leaves(where: str, output: torch.Tensor, known: Sequence[torch.Tensor]) -> None:
    ids = {id(t) for t in known}
    if any(id(t) not in ids for t in _leaves(output)):
        raise ValueError(f"{where}: the function uses a trainable tensor that is neither in compute_params nor a "
                         "parameter of `self`; list it in compute_params")


def _mark_ready(params: Sequence[torch.Tensor], ready: bool) -> None:
    for p in params:
        p.ds_grad_is_ready = ready


def _add(acc: List[Optional[torch.Tensor]], grads: Sequence[Optional[torch.Tensor]]) -> None:
    for i, g in enumerate(grads):
        if g is not None:
            acc[i] = g if acc[i] is None else acc[i].add_(g)


def _spans(length: int, shards: int) -> List[Tuple[int, int]]:
    """torch.chunk's slices of `length`: ceil(length / shards) each, the last shorter, as many
    as that takes (possibly fewer than `shards`)."""
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"tiled compute: shards must be a positive int, not {shards!r}")
    step = max(1, math.ceil(length / shards))
    return [(lo, min(lo + step, length)) for lo in range(0, length, step)] or [(0, 0)]


# -- TiledMLP ---------------------------------------------------------------------------------
class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, x, shards, *params):
        ctx.fn, ctx.module, ctx.spans = fn, module, _spans(x.shape[-2], shards)
        ctx.params = params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, x.narrow(-2, lo, hi - lo)) for lo, hi in ctx.spans], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params, want_x = ctx.params, ctx.needs_input_grad[2]
        x_grad = torch.zeros_like(x) if want_x else None
        p_grads: List[Optional[torch.Tensor]] = [None] * len(params)
        for i, (lo, hi) in enumerate(ctx.spans):
            _mark_ready(params, i + 1 == len(ctx.spans))
            xs = x.detach().narrow(-2, lo, hi - lo).requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, xs)
            if i == 0:
                _check_leaves("TiledMLP", out, (xs,) + tuple(params))
            inputs = ([xs] if want_x else []) + list(params)
            if not inputs or not out.requires_grad:
                continue
            got = torch.autograd.grad(out, inputs, grad.narrow(-2, lo, hi - lo), allow_unused=True)
            if want_x:
                x_grad.narrow(-2, lo, hi - lo).copy_(got[0])
                got = got[1:]
            _add(p_grads, got)
        return (None, None, x_grad, None) + tuple(p_grads)


class TiledMLP:
    """A per-token function (an MLP) of x ([b, s, h] or [s, h]) run over `shards` slices of the
    sequence (dim -2) one at a time, recomputed slice by slice in backward:

        TiledMLP.apply(fn, self, x, shards, compute_params)   # fn(self, x_slice) -> out_slice

    As DeepSpeed's (an autograd function there); the gradients of `compute_params` and of
    self's parameters are accumulated over the slices and handed to autograd once."""

    @staticmethod
    def apply(fn: Callable, self, x: torch.Tensor, shards: int, compute_params: Optional[Iterable] = None):
        params = _trainable(self, compute_params)
        return _TiledMLP.apply(fn, self, x, shards, *params)


# -- SequenceTiledCompute ---------------------------------------------------------------------
REDUCTIONS = (None, "mean", "sum")


class _SequenceTiledCompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, key, out_dim, reduction, n_args, *rest):
        args, params = rest[:n_args], rest[n_args:]
        sharded = dict(zip(keys_to_shard, args[:len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard):]))
        step = math.ceil(seqlen / shards)
        # DeepSpeed's slices: ceil(seqlen / shards) along dim 1; trailing empty ones are skipped
        spans = [(lo, min(lo + step, seqlen)) for lo in range(0, seqlen, step)]
        ctx.fn, ctx.spans, ctx.key, ctx.out_dim, ctx.reduction = fn, spans, key, out_dim, reduction
        ctx.sharded, ctx.passed, ctx.params = sharded, passed, params
        ctx.key_index = (list(keys_to_shard) + list(keys_to_pass)).index(key)
        ctx.n_args = n_args
        with torch.no_grad():
            outs = [fn(**{k: v[:, lo:hi] for k, v in sharded.items()}, **passed) for lo, hi in spans]
            out = torch.stack(outs) if out_dim == 0 else torch.cat(outs, dim=out_dim)
            ctx.out_shape, ctx.out_numel = out.shape, out.numel()
            if reduction == "mean":
                return out.mean()
            return out.sum() if reduction == "sum" else out

    @staticmethod
    def backward(ctx, grad):
        params, want = ctx.params, ctx.needs_input_grad[9 + ctx.key_index]
        target = ctx.sharded[ctx.key]
        if ctx.reduction is not None:  # d(sum)/d(each) = 1, d(mean)/d(each) = 1/n
            grad = grad.expand(ctx.out_shape) / (ctx.out_numel if ctx.reduction == "mean" else 1)
        key_grad = torch.zeros_like(target) if want else None
        p_grads: List[Optional[torch.Tensor]] = [None] * len(params)
        off = 0
        passed = {k: v.detach() if torch.is_tensor(v) else v for k, v in ctx.passed.items()}
        for i, (lo, hi) in enumerate(ctx.spans):
            _mark_ready(params, i + 1 == len(ctx.spans))
            kw = {k: v.detach()[:, lo:hi] for k, v in ctx.sharded.items()}
            kw[ctx.key] = kw[ctx.key].requires_grad_(want)
            with torch.enable_grad():
                out = ctx.fn(**kw, **passed)
            if i == 0:
                _check_leaves("SequenceTiledCompute", out, (kw[ctx.key],) + tuple(params))
            if ctx.out_dim == 0:
                g = grad[i]
            else:
                n = out.shape[ctx.out_dim]
                g, off = grad.narrow(ctx.out_dim, off, n), off + n
            inputs = ([kw[ctx.key]] if want else []) + list(params)
            if not inputs or not out.requires_grad:
                continue
            got = torch.autograd.grad(out, inputs, g, allow_unused=True)
            if want:
                key_grad[:, lo:hi].copy_(got[0])
                got = got[1:]
            _add(p_grads, got)
        arg_grads = [None] * ctx.n_args
        arg_grads[ctx.key_index] = key_grad
        return (None,) * 9 + tuple(arg_grads) + tuple(p_grads)


class SequenceTiledCompute:
    """Any function of tensors shaped [b, s, ...] run over `shards` slices of dim 1 one at a
    time and recomputed slice by slice in backward; only `grad_requiring_tensor_key` (and the
    weights) get gradients. DeepSpeed's positional form:

        SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
                                   grad_requiring_tensor_key, compute_params,
                                   output_unshard_dimension, output_reduction, *args)

    where args are the values of keys_to_shard then keys_to_pass. The slices' outputs are
    concatenated along output_unshard_dimension (0: stacked, for one scalar per slice), then
    reduced by output_reduction (None, "mean" or "sum")."""

    @staticmethod
    def apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
              output_unshard_dimension, output_reduction, *args):
        keys_to_shard, keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        where = "SequenceTiledCompute"
        if output_reduction not in REDUCTIONS:
            raise ValueError(f"{where}: output_reduction must be None, 'mean' or 'sum', not {output_reduction!r}")
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"{where}: {len(args)} values for {len(keys_to_shard) + len(keys_to_pass)} keys")
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"{where}: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of "
                             f"the sharded keys {keys_to_shard}")
        _spans(int(seqlen), shards)  # shards must be a positive int
        for k, v in zip(keys_to_shard + keys_to_pass, args):
            if k != grad_requiring_tensor_key and torch.is_tensor(v) and v.requires_grad:
                raise ValueError(f"{where}: {k!r} requires grad, but only grad_requiring_tensor_key "
                                 f"({grad_requiring_tensor_key!r}) gets a gradient; detach it")
            if k in keys_to_shard and (not torch.is_tensor(v) or v.dim() < 2 or v.shape[1] != seqlen):
                raise ValueError(f"{where}: {k!r} to shard must be a tensor [b, {seqlen}, ...]")
        params = _trainable(None, compute_params)
        return _SequenceTiledCompute.apply(fn, int(seqlen), shards, tuple(keys_to_shard), tuple(keys_to_pass),
                                           grad_requiring_tensor_key, output_unshard_dimension, output_reduction,
                                           len(args), *args, *params)


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard: Dict, kwargs_to_pass: Dict, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension: int = 1, output_reduction="mean"):
    """SequenceTiledCompute with keyword dicts: fn(**slices of kwargs_to_shard, **kwargs_to_pass)."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


# -- TiledFusedLogitsLoss ---------------------------------------------------------------------
class _TiledFusedLogitsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, reduction, want_grad, *params):
        b, s = x.shape[:2]
        xf = x.detach().reshape(b * s, *x.shape[2:])
        yf = y.reshape(b * s, *y.shape[2:])
        mf = mask.reshape(-1) if mask is not None else None
        spans = _spans(b * s, shards)
        scale = 1.0 / len(spans) if reduction == "mean" else 1.0
        want_x = want_grad and x.requires_grad
        x_grad = torch.zeros_like(xf) if want_x else None
        p_grads: List[Optional[torch.Tensor]] = [None] * len(params)
        losses = []
        for i, (lo, hi) in enumerate(spans):
            _mark_ready(params, i + 1 == len(spans))
            xs = xf[lo:hi].requires_grad_(want_x)
            args = (module, xs, yf[lo:hi]) + ((mf[lo:hi],) if mf is not None else ())
            inputs = ([xs] if want_x else []) + list(params)
            if not (want_grad and inputs):
                with torch.no_grad():
                    losses.append(fn(*args).detach())
                continue
            with torch.enable_grad():
                out = fn(*args)
            if i == 0:
                _check_leaves("TiledFusedLogitsLoss", out, (xs,) + tuple(params))
            got = torch.autograd.grad(out, inputs, torch.full_like(out, scale), allow_unused=True)
            losses.append(out.detach())
            if want_x:
                x_grad[lo:hi].copy_(got[0])
                got = got[1:]
            _add(p_grads, got)
        ctx.grads = (x_grad.view_as(x) if want_x else None, p_grads)
        out = torch.stack(losses)
        return out.mean() if reduction == "mean" else out.sum()

    @staticmethod
    def backward(ctx, grad):
        x_grad, p_grads = ctx.grads
        ctx.grads = None
        scaled = [None if g is None else g.mul_(grad) for g in [x_grad] + list(p_grads)]
        return (None, None, scaled[0], None, None, None, None, None) + tuple(scaled[1:])


class TiledFusedLogitsLoss:
    """A loss over logits that never exist for the whole sequence: x ([b, s, h], typically the
    last hidden states) and y ([b, s, ...], the labels shifted for the next token) flattened
    to b x s rows, cut into `shards` slices, loss_fn(self, x_slice, y_slice[, mask_slice]) per
    slice with its backward at once; the slices' losses reduced by "mean" or "sum".

        TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)
    """

    @staticmethod
    def apply(fn, self, x, y, mask, shards, compute_params, output_reduction):
        where = "TiledFusedLogitsLoss"
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"{where}: output_reduction must be 'mean' or 'sum', not {output_reduction!r}")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(f"{where}: x and y must be [batch, seq, ...] with the same batch and seq, "
                             f"not {tuple(x.shape)} and {tuple(y.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"{where}: mask must be [batch, seq] = {tuple(x.shape[:2])}, not {tuple(mask.shape)}")
        params = _trainable(self, compute_params)
        want_grad = torch.is_grad_enabled() and (x.requires_grad or bool(params))
        return _TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, output_reduction, want_grad, *params)


# -- the causal LM loss, tiled ----------------------------------------------------------------
def shift_labels_of(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Token t's target is token t+1: labels shifted left, the last position ignored."""
    return torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()


def tiled_causal_lm_loss(hidden_states: torch.Tensor, lm_head, shards: int, labels: Optional[torch.Tensor] = None,
                         shift_labels: Optional[torch.Tensor] = None, group=None, ignore_index: int = -100,
                         compute_params=None) -> torch.Tensor:
    """Cross-entropy of lm_head(hidden_states) against the next tokens, the mean over the
    labelled tokens, computed `shards` slices at a time (TiledFusedLogitsLoss with sums), so
    [b, s, vocab] logits never exist; logits are taken in fp32.

    Give `labels` (shifted here) or `shift_labels` (already shifted over the whole sequence,
    as UlyssesSPDataLoaderAdapter's batches carry). With `group` (a Ulysses sequence group,
    each rank holding a slice) the mean is over the group's labelled tokens, as one process
    over the whole sequence would take it."""
    from .ulysses_sp import sequence_parallel_loss

    if (labels is None) == (shift_labels is None):
        raise ValueError("tiled_causal_lm_loss: give labels or shift_labels, one of them")
    if labels is not None:
        from ..core import comm

        if group is not None and comm.get_world_size(group) > 1:
            raise ValueError("tiled_causal_lm_loss: under sequence parallelism give shift_labels (a slice cannot "
                             "shift its labels: its last token's target is on the next rank)")
        shift_labels = shift_labels_of(labels, ignore_index)

    def loss_sum(head, x, y):
        logits = head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1),
                                                 ignore_index=ignore_index, reduction="sum")

    total = TiledFusedLogitsLoss.apply(loss_sum, lm_head, hidden_states, shift_labels, None, shards, compute_params,
                                       "sum")
    n = (shift_labels != ignore_index).sum()
    mean = total / n.clamp(min=1).to(total.dtype)
    return mean if group is None else sequence_parallel_loss(mean, shift_labels, group, ignore_index)
