"""`deepspeed.runtime.activation_checkpointing.offload_activations`: offload the hidden states
that non-reentrant torch checkpointing saves to host memory, through saved-tensor hooks.

Inside `with CheckpointHiddenStatesOffload(...)`, every tensor autograd saves passes the pack
hook. Only tensors marked first (`mark(t)`, once per expected save) go to the engine
(host_offload.py); the rest, the final norm and head included, stay as they are. The unpack hook
brings an offloaded tensor back when the backward (or the checkpoint's recompute) wants it.

With `transformers` installed, entering the first context wraps
`transformers.GradientCheckpointingLayer.__call__` so a checkpointing layer in training marks its
first positional argument (the hidden states) itself; leaving the last context puts the class
back as it was.
"""
from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch.autograd.graph import saved_tensors_hooks

from .host_offload import CheckpointActivationOffloadStats, _ActivationOffloadEngine

__all__ = ["CheckpointHiddenStatesOffload", "CheckpointActivationOffloadStats",
           "get_checkpoint_hidden_states_offloading_ctx_manager", "patch_gradient_checkpointing_layer_marker"]


@dataclass(frozen=True)
class _OffloadedTensorRef:
    """What the pack hook leaves in the graph in place of an offloaded tensor."""

    tensor_id: int


# the contexts open on this thread, innermost last: the marker marks for the innermost
_LOCAL = threading.local()


def _open_contexts() -> List["CheckpointHiddenStatesOffload"]:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@dataclass
class _MarkerPatch:
    """The state of the GradientCheckpointingLayer wrapper, shared by all threads."""

    wrapper: Optional[object] = None  # the installed __call__, None when not installed
    owned_call: Optional[object] = None  # the class's own __call__ before (None: inherited)
    by_context: bool = False  # a context installed it, so the last one to leave removes it
    users: int = 0  # open contexts while it is installed


_PATCH = _MarkerPatch()
_PATCH_LOCK = threading.Lock()


def _gradient_checkpointing_layer():
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as err:
        raise RuntimeError("patch_gradient_checkpointing_layer_marker needs transformers >= 4.52 (the release "
                           f"with GradientCheckpointingLayer): {err}") from err
    return GradientCheckpointingLayer


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wrap GradientCheckpointingLayer.__call__ to mark args[0] for the innermost open context."""
    if _PATCH.wrapper is not None:
        return
    layer_cls = _gradient_checkpointing_layer()
    inner_call = layer_cls.__call__

    def _marking_call(self, *args, **kwargs):
        contexts = _open_contexts()
        context = contexts[-1] if contexts else None
        marked = None
        # transformers checkpoints only the first positional argument; a hidden_states passed by
        # keyword rides in the partial and is never saved, so it is not marked
        if (context is not None and self.training and torch.is_grad_enabled()
                and getattr(self, "gradient_checkpointing", False) and args and torch.is_tensor(args[0])):
            marked = args[0]
            context.mark(marked)
        try:
            return inner_call(self, *args, **kwargs)
        finally:
            if marked is not None:
                # a mark the pack hook did not use must not outlive the call: id() is reused
                context._consume_mark(marked)

    _PATCH.owned_call = layer_cls.__dict__.get("__call__")
    layer_cls.__call__ = _marking_call
    _PATCH.wrapper = _marking_call


def _unpatch_marker() -> None:
    wrapper, owned = _PATCH.wrapper, _PATCH.owned_call
    _PATCH.wrapper = _PATCH.owned_call = None
    if wrapper is None:
        return
    layer_cls = _gradient_checkpointing_layer()
    if layer_cls.__dict__.get("__call__") is not wrapper:
        return  # someone wrapped it again after us: leave theirs in place
    if owned is None:
        del layer_cls.__call__
    else:
        layer_cls.__call__ = owned


class CheckpointHiddenStatesOffload(_ActivationOffloadEngine, saved_tensors_hooks):
    """Saved-tensor hooks that offload marked tensors to host memory; `stats` counts what happened."""

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64, keep_last_count: int = 1) -> None:
        _ActivationOffloadEngine.__init__(self, use_pin_memory=use_pin_memory, use_streams=use_streams,
                                          min_offload_bytes=min_offload_bytes,
                                          max_fwd_stash_count=max_fwd_stash_count,
                                          max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                          keep_last_count=keep_last_count)
        self._allowed: Dict[int, int] = {}  # id(tensor) -> saves still to offload
        saved_tensors_hooks.__init__(self, self._pack_tensor, self._unpack_tensor)

    # -- marks ----------------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        """Offload the next save of `tensor` (mark twice for two saves)."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        left = self._allowed.get(id(tensor), 0)
        if left <= 0:
            return False
        if left == 1:
            del self._allowed[id(tensor)]
        else:
            self._allowed[id(tensor)] = left - 1
        return True

    # -- the hooks ------------------------------------------------------------------------------
    def _pack_tensor(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else _OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed):
        if isinstance(packed, _OffloadedTensorRef):
            return self._restore_tensor(packed.tensor_id, cache=True)
        return packed

    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def _sync_and_clear(self) -> None:
        super()._sync_and_clear()
        self._allowed.clear()

    # -- the context ----------------------------------------------------------------------------
    def __enter__(self):
        if self in _open_contexts():
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant: open a second instance for a "
                               "nested context")
        with _PATCH_LOCK:
            if _PATCH.wrapper is None and importlib.util.find_spec("transformers") is not None:
                patch_gradient_checkpointing_layer_marker()
                _PATCH.by_context = True
            if _PATCH.wrapper is not None:
                _PATCH.users += 1
        self.reset()
        _open_contexts().append(self)
        try:
            return super().__enter__()
        except BaseException:
            self._leave()
            raise

    def _leave(self) -> None:
        contexts = _open_contexts()
        if self in contexts:
            contexts.remove(self)
        with _PATCH_LOCK:
            _PATCH.users = max(0, _PATCH.users - 1)
            if _PATCH.users == 0 and _PATCH.by_context:
                _unpatch_marker()
                _PATCH.by_context = False

    def __exit__(self, *exc_info):
        # the hooks come off and the marker goes whatever happens; a failed wait for the copies
        # is raised after that
        try:
            self._sync_and_clear()
        finally:
            try:
                self._leave()
            finally:
                super().__exit__(*exc_info)
        return None


def get_checkpoint_hidden_states_offloading_ctx_manager(
        use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1) -> CheckpointHiddenStatesOffload:
    """A CheckpointHiddenStatesOffload with these settings (DeepSpeed's factory)."""
    return CheckpointHiddenStatesOffload(use_pin_memory=use_pin_memory, use_streams=use_streams,
                                         min_offload_bytes=min_offload_bytes,
                                         max_fwd_stash_count=max_fwd_stash_count,
                                         max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
                                         keep_last_count=keep_last_count)
