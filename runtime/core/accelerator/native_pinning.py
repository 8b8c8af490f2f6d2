"""`deepspeed.utils.pin_memory`: DeepSpeed's native (mlock) host-pinning backend, refused.

DeepSpeed can pin host buffers with its own page-locked allocator (the pin_memory op, chosen
by DS_PIN_MEMORY_BACKEND=native) instead of torch's `Tensor.pin_memory()`. dslaunch pins
through torch only (the accelerator's pin_memory, counted by pin_memory_tracker), so the
native backend is refused: constructing it, or asking for it with the variable set, raises
one line saying so. That is also what DeepSpeed does wherever its op cannot be built (its
CPU accelerator included): the constructor raises, and callers fall back or skip.
"""
from __future__ import annotations

import os

BACKEND_VARIABLE = "DS_PIN_MEMORY_BACKEND"
REASON = ("DeepSpeed's native pinned-memory backend (the pin_memory op's mlock allocator, "
          f"{BACKEND_VARIABLE}=native) is not provided: dslaunch pins host memory with torch's "
          f"pin_memory(); unset {BACKEND_VARIABLE} or set it to torch")


class NativePinnedMemory:
    """DeepSpeed's native pinning handle: refused on construction (see the module's doc)."""

    def __init__(self) -> None:
        raise RuntimeError(REASON)


def native_backend_selected() -> bool:
    """Whether DS_PIN_MEMORY_BACKEND asks for the native backend (DeepSpeed's default: torch)."""
    return os.environ.get(BACKEND_VARIABLE, "torch").strip().lower() == "native"


# DeepSpeed's process-wide handle, built on first use; none is ever built here (construction
# is refused), so it stays None
_shared_native_pins = None


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process's native pinning handle: refused, as NativePinnedMemory() is."""
    if _shared_native_pins is not None:
        return _shared_native_pins
    return NativePinnedMemory()


def get_active_native_pinned_memory():
    """None under torch pinning (the default); with DS_PIN_MEMORY_BACKEND=native, the refusal."""
    if not native_backend_selected():
        return None
    return get_native_pinned_memory()


__all__ = ["NativePinnedMemory", "get_native_pinned_memory", "get_active_native_pinned_memory"]
