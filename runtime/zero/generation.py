"""unwrap_model_for_generation (DeepSpeed's deepspeed.runtime.zero name): generate with a
ZeRO-3 engine's model gathered once, instead of an all-gather per module per token.

Inside the context every parameter is whole on every rank and the stage-3 hooks are off,
so a generate() loop runs as on a plain module; on the way out the hooks come back (with a
fresh forward-order record: generation's forwards are not the training step's) and the
parameters are partitioned again, with any change a rank made to them discarded, as
GatheredParameters does without a modifier rank. Below stage 3 nothing is partitioned and
the engine is handed over as it is (DeepSpeed supports only stage 3 here).
"""
from __future__ import annotations

import contextlib

from .params import GatheredParameters


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """`model` is the engine deepspeed.initialize returned; the context yields it."""
    strategy = getattr(model, "strategy", None)
    if not hasattr(strategy, "hooks_suspended"):
        yield model
        return
    with GatheredParameters(list(model.module.parameters())):
        with strategy.hooks_suspended():
            yield model
