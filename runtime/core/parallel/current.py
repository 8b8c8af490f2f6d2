"""The mesh the most recently built engine runs on, for code that asks for groups without an
engine at hand (DeepSpeed's `deepspeed.utils.groups`, which Accelerate and Hugging Face call).
The engine records its mesh here once built; nothing here imports the engine."""
from __future__ import annotations

from typing import Any, Optional

_mesh: Optional[Any] = None


def set_current(mesh) -> None:
    global _mesh
    _mesh = mesh


def current():
    """The latest engine's mesh, or None before any engine was built."""
    return _mesh
