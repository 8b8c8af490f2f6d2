"""engine.compile() and the `compile` section: torch.compile on the engine's module.

The section's torch.compile arguments (backend, fullgraph, dynamic, mode, options,
disable, kwargs) are the defaults; engine.compile(backend=..., compile_kwargs={...})
overrides them, as DeepSpeed's does. The module's forward is compiled in place, so the
engine's hooks, state_dict names and checkpoints are the same as uncompiled. (DeepSpeed
calls nn.Module.compile, which torch skips for torch.nn's own classes such as
nn.Sequential; compiling the bound forward captures those too.) `compile.enabled`
(DeepSpeed 0.14's spelling) compiles at initialize().
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..core.strict import ConfigError


def compile_module(module: torch.nn.Module, section, backend: Optional[str] = None,
                   compile_kwargs: Optional[Dict[str, Any]] = None, schedule=None,
                   compiled_autograd_enabled: bool = False) -> Dict[str, Any]:
    if schedule is not None:
        raise ConfigError("engine.compile(schedule=...): DeepCompile schedules are not supported; call compile() "
                          "without one (torch.compile)")
    if compiled_autograd_enabled:
        raise ConfigError("engine.compile(compiled_autograd_enabled=True): compiled autograd is not supported; "
                          "leave it false")
    kwargs = section.torch_compile_kwargs()
    if backend is not None:
        kwargs["backend"] = backend
    kwargs.update(compile_kwargs or {})
    module.forward = torch.compile(module.forward, **kwargs)
    return kwargs
