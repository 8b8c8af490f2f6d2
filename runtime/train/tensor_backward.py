"""PyTorch-style backward through an engine's outputs: `loss.backward()`, `out.backward(grad)`
and `engine.scale(loss).backward()` in place of `engine.backward(loss)` (DeepSpeed 0.19).

`engine(batch)` returns its outputs through `OutputGrads.wrap`: every output tensor that
needs a gradient is handed back as an alias, the output of a small autograd function
(`_OutputAlias`: the same storage, a node of its own). The first gradient that reaches one
of these nodes in a backward pass runs the engine's backward prologue (the strategy learns
whether this micro-step ends an accumulation window) and queues the epilogue on the
autograd engine, which runs it once the whole backward pass is done (reductions at the
boundary, bucket flushes, the gradient window); every gradient that reaches one is divided
by the gradient accumulation steps on its way in, as engine.backward divides the loss.

Why an alias and not a hook on the output itself (DeepSpeed hooks the outputs): a model
that returns both a loss and the logits it was computed from (a Hugging Face model's
ModelOutput) would have the loss's gradient divided at the loss and again at the logits,
1/gas^2 in all (DeepSpeed 0.19.8 trains so with `loss.backward()` and accumulation at ZeRO
1 and 2). The alias receives only what the script's own graph sends it, so each gradient
is divided once, whatever the script does with the outputs, in place or not.

While any engine's `engine.backward()` runs (the module-level count below), the aliases
neither divide nor start a prologue of their own engine: engine.backward scaled the loss
and runs its own prologue and epilogue. Another engine whose outputs take part in that
loss still runs its prologue and epilogue from its aliases, without dividing, as in
DeepSpeed (two engines, one combined loss, `engine_a.backward(loss)`).
"""
from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any, Callable, Optional

import torch

_engine_backward_running = 0  # engine.backward() calls in progress, over every engine


class BackwardUsageError(AssertionError):
    """A call the engine refuses as DeepSpeed refuses it with an assertion (engine.scale of
    something that is no scalar loss, no_sync at ZeRO stage 2 or 3, step() inside no_sync):
    an AssertionError, so scripts and tests that expect DeepSpeed's keep working."""


# DeepSpeed 0.19.8's words, so a script that matches on them sees the same line.
SCALE_REQUIRED = ("Loss scaling is required for this configuration, but backward() was called directly without "
                  "scaling the loss. Please use one of the following: 1. engine.backward(loss) "
                  "2. engine.scale(loss).backward()")
# Under a static scale DeepSpeed 0.19.8 raises nothing: it lets the unscaled loss's gradients
# through and divides them by the scale at the step. Refused here, its words first, then why.
STATIC_SCALE_UNSCALED = ("a static fp16 loss_scale needs it too: DeepSpeed 0.19.8 lets loss.backward() run unscaled "
                         "there and then divides the gradients by the scale")
SCALE_REQUIRED_STATIC = f"{SCALE_REQUIRED} ({STATIC_SCALE_UNSCALED})"


@contextlib.contextmanager
def engine_backward():
    """Around the `.backward()` that engine.backward() runs: output aliases pass gradients on
    unchanged (the loss is already divided) and leave their engine's prologue to it."""
    global _engine_backward_running
    _engine_backward_running += 1
    try:
        yield
    finally:
        _engine_backward_running -= 1


def engine_backward_running() -> bool:
    return _engine_backward_running > 0


def _functorch_transforming() -> bool:
    """Under torch.func.grad / vmap / jacrev the transform owns differentiation: outputs are
    left unhooked (DeepSpeed skips its hooks there too)."""
    functorch = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def _graph_task() -> int:
    """The id of the backward pass running now (-1 outside one)."""
    return torch._C._current_graph_task_id()


class _OutputAlias(torch.autograd.Function):
    """An output's alias: the same storage and version counter (so autograd still sees an
    in-place change of it), but a node of its own in the graph, which receives exactly the
    gradient the script's graph sends to the output. Not a view: a script may change the
    alias in place (`loss *= k`) and this node still receives the gradient, of the value it
    had; a view's hook would be dropped by that change."""

    @staticmethod
    def forward(ctx, t, owner):
        ctx.owner = owner
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        owner = ctx.owner()
        return (grad if owner is None else owner._on_grad(grad)), None


class OutputGrads:
    """One engine's output aliases. `started()` runs the prologue and returns the epilogue
    to queue; `divisor()` is the gradient accumulation steps; `own_backward()` says whether
    this engine's own engine.backward() is running."""

    def __init__(self, started: Callable[[], Callable[[], None]], divisor: Callable[[], int],
                 own_backward: Callable[[], bool]):
        self._started = started
        self._divisor = divisor
        self._own_backward = own_backward
        self._task: Optional[int] = None  # the backward pass whose prologue ran (its epilogue is queued)

    def wrap(self, out: Any) -> Any:
        """`out` with every tensor that needs a gradient replaced by its alias (inside
        tuples, lists, dicts and Hugging Face ModelOutputs; other objects are returned as they
        are, as DeepSpeed leaves them unhooked)."""
        if _functorch_transforming():
            return out
        return self._wrap(out)

    def _wrap(self, out: Any) -> Any:
        if torch.is_tensor(out):
            return self._alias(out) if out.requires_grad and out.grad_fn is not None else out
        if isinstance(out, dict):
            changed = {k: self._wrap(v) for k, v in out.items()}
            if all(changed[k] is out[k] for k in out):
                return out
            if hasattr(out, "to_tuple"):  # a ModelOutput: set in place, its attributes follow its items
                for k, v in changed.items():
                    out[k] = v
                return out
            if type(out) in (dict, collections.OrderedDict):
                return type(out)(changed)
            for k, v in changed.items():  # another mapping type: its items are set in place
                out[k] = v
            return out
        if isinstance(out, (tuple, list)):
            items = [self._wrap(v) for v in out]
            if all(a is b for a, b in zip(items, out)):
                return out
            if isinstance(out, list):
                if type(out) is list:
                    return items
                out[:] = items  # another list type: its items are set in place
                return out
            if hasattr(out, "_fields"):  # a namedtuple
                return type(out)(*items)
            return tuple(items) if type(out) is tuple else type(out)(items)
        return out

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        return _OutputAlias.apply(t, weakref.ref(self))  # weak: the alias must not keep the engine alive

    def _on_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if engine_backward_running():
            if not self._own_backward():
                self._start()  # another engine's engine.backward: this engine's part still needs both ends
            return grad
        self._start()
        gas = self._divisor()
        return grad / gas if gas != 1 else grad

    def _start(self) -> None:
        task = _graph_task()
        if task == self._task and task != -1:
            return  # this backward pass already ran the prologue
        epilogue = self._started()
        self._task = task

        def done():
            self._task = None
            epilogue()

        torch.autograd.Variable._execution_engine.queue_callback(done)
