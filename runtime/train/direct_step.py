"""`engine.optimizer.step()` called by a script, where the strategy owns the step.

Under ZeRO 1-3, and at stage 0 with fp32 masters (bf16, fp16), the optimizer's groups hold
the strategy's tensors (masters, flat partitions), not the module's parameters, and the
gradients to step with sit in the strategy's buffers. A script that calls the returned
optimizer's step() itself, as a PyTorch loop does, would step masters whose .grad is None:
nothing would train and nothing would say so. DeepSpeed 0.19.8 returns its ZeRO (or bf16 /
fp16) optimizer there, whose step() reduces, clips, steps, writes the parameters back and
frees the gradients, without moving the engine's LR scheduler or step counters.

So that call is routed here to the engine's step without the scheduler and the counters.
The engine's own steps (and anything they call, such as an offload host stepping the
optimizer) pass through to the optimizer's real step. Where the groups hold the module's own
parameters (stage 0, fp32), step() is torch's and is left alone, as DeepSpeed leaves it.

The route is a bound method, so torch's LR schedulers, which wrap `optimizer.step` to notice
its calls, wrap it like any optimizer's step.

`optimizer.zero_grad()` under ZeRO 1-3 is DeepSpeed's ZeRO optimizer's too: it clears the
module parameters' gradients (and stage 1's `grad_accum` sums) where torch's would only clear
the masters'; at stage 3 the next backward's gradients also overwrite the averaged partitions
instead of adding to them (DeepSpeed resets its micro-step count there). The engine never
calls it itself.
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable


class DirectStepRoute:
    """The route on one engine's optimizer: a script's step() runs `script_step`; inside
    `passing_through()` (the engine's own step) it is the optimizer's real step."""

    def __init__(self, script_step: Callable[[], None]):
        self._script_step = script_step
        self._passing = False

    @contextlib.contextmanager
    def passing_through(self):
        self._passing = True
        try:
            yield
        finally:
            self._passing = False

    def install(self, optimizer) -> None:
        real_step = optimizer.step
        route = self

        def step(opt, *args, **kwargs):
            if route._passing:
                return real_step(*args, **kwargs)
            if args or kwargs:
                raise TypeError("engine.optimizer.step() takes no closure or arguments: the engine computes the "
                                "loss and gradients (engine.backward) before the step")
            route._script_step()
            return None

        optimizer.step = types.MethodType(step, optimizer)


def route_direct_step(engine, script_step: Callable[[], None]) -> "DirectStepRoute | _NoRoute":
    """Install the route on engine.optimizer where the strategy owns the step. The engine runs its
    own optimizer step inside the returned object's passing_through(), a no-op where nothing was
    routed (no optimizer, or stage 0 with the module's own parameters in the groups)."""
    optimizer = engine.optimizer
    if optimizer is None:
        return _NoRoute()
    module_params = {id(p) for p in engine.module.parameters()}
    owns_groups = all(id(p) in module_params for g in optimizer.param_groups for p in g["params"])
    if engine.zero_optimization_stage() == 0 and owns_groups:
        return _NoRoute()
    route = DirectStepRoute(script_step)
    route.install(optimizer)
    if engine.zero_optimization_stage() >= 1:
        optimizer.zero_grad = types.MethodType(_zero_grad_for(engine), optimizer)
    return route


class _NoRoute:
    """Where step() is torch's own: the engine's step needs no pass-through."""

    def passing_through(self):
        return contextlib.nullcontext()


def _zero_grad_for(engine):
    def zero_grad(opt, set_to_none: bool = True):
        for p in engine.module.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
            if getattr(p, "grad_accum", None) is not None:
                p.grad_accum = None
        if engine.zero_optimization_stage() == 3:
            engine.strategy.restart_accumulation()

    return zero_grad
