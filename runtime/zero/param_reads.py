"""Parameters read by name, for stage 3 to find the ones a forward uses outside their own module.

A ZeRO-3 module's hooks gather the parameters it owns. A forward may also read another
module's parameter by name, `F.linear(x, self.embed.weight)` in a parent (an output layer
tied by hand, a weight read by a sibling), after that module's own forward released it: the
read would see an empty tensor. DeepSpeed 0.19.8 finds such reads during a forward, gathers the
parameter and registers it as external to the module whose forward is running, so that
module's hooks gather it from then on (its ZeROOrderedDict). Here too: each module's
`_parameters` becomes a `ReadWatch`, a dict that calls back on every read by name (what
`module.weight` does through Module.__getattr__), and stage 3 decides what a read needs.
Iteration (`parameters()`, `state_dict()`) does not call back.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch


class ReadWatch(dict):
    """A module's `_parameters` that calls `on_read(param)` whenever one is read by name.
    DeepSpeed's ZeROOrderedDict (`deepspeed.runtime.zero.parameter_offload`), with its
    constructor: `ReadWatch(parent_module, items)`; without `on_read` a read calls nothing
    until an engine's watches (ReadWatches) take it over."""

    __slots__ = ("on_read", "_parent_module")

    def __init__(self, parent_module=None, *args, on_read: Optional[Callable[[torch.nn.Parameter], None]] = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self.on_read = on_read

    def __getitem__(self, key):
        p = dict.__getitem__(self, key)
        if p is not None and self.on_read is not None:
            self.on_read(p)
        return p

    def __reduce__(self):
        # a copy (deepcopy, pickling) is a plain dict: it must not carry the engine along
        return dict, (dict(self),)


def ensure_zero_ordered_dict(module) -> None:
    """DeepSpeed's helper: give `module` a ReadWatch for a plain-dict `_parameters` (torch's
    default), keeping the first container it replaces as `module._original_parameters`; a
    watched, missing or non-dict `_parameters` is left alone."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ReadWatch) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ReadWatch(module, params)


class ReadWatches:
    """The watches installed on a model's modules; `remove()` gives each module a plain dict back."""

    def __init__(self, model: torch.nn.Module, on_read: Callable[[torch.nn.Parameter], None]):
        self.modules: List[torch.nn.Module] = []
        self.on_read = on_read
        self.cover(model)

    def cover(self, model: torch.nn.Module) -> None:
        """Watch every module of `model` not yet watched by this engine: those there at
        initialize, and those attached since (DeepSpeed converts them in its forward prologue)."""
        for m in model.modules():
            params = m.__dict__.get("_parameters")
            if type(params) is dict:
                m._parameters = ReadWatch(m, params, on_read=self.on_read)
                self.modules.append(m)
            elif isinstance(params, ReadWatch) and params.on_read is None:  # wrapped by the helper
                params.on_read = self.on_read
                self.modules.append(m)

    def remove(self) -> None:
        for m in self.modules:
            if isinstance(m.__dict__.get("_parameters"), ReadWatch):
                m._parameters = dict(m._parameters)
        self.modules.clear()
