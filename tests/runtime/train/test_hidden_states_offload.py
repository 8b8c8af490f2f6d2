"""CheckpointHiddenStatesOffload (deepspeed.runtime.activation_checkpointing.offload_activations)
through its public interface: gradients with offload equal plain torch's (no checkpointing, no
offload), the saved inputs really sit in separate host buffers between forward and backward,
the transformers marker marks a checkpointing layer's hidden states and comes off again, and
bad settings or a use after the context fail in one line.

The CPU never offloads (as DeepSpeed); the accelerator is made to answer that the host is an
unsynchronised device (scripts/offload_activations_cases.host_as_device) so the path runs.
"""
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from script_modules import load_script

from dslaunch.runtime.core.accelerator import get_accelerator
from dslaunch.runtime.train.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload, get_checkpoint_hidden_states_offloading_ctx_manager)

cases = load_script("offload_activations_cases")


@pytest.fixture
def host_device():
    with cases.host_as_device(get_accelerator()):
        yield


def _reference(seed):
    """Plain torch: the same chain, no checkpointing, no offload."""
    torch.manual_seed(seed)
    layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(8, 16, requires_grad=True)
    h = x
    for layer in layers:
        h = layer(h)
    loss = h.square().sum()
    loss.backward()
    return loss.detach(), x.grad.clone(), [p.grad.clone() for p in layers.parameters()]


def _offloaded(seed, manager, inspect=None):
    torch.manual_seed(seed)
    layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(8, 16, requires_grad=True)
    with manager:
        loss = cases.chain_loss(layers, x, manager)
        if inspect is not None:
            inspect(manager, x)
        loss.backward()
    return loss.detach(), x.grad.clone(), [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
def test_gradients_with_offload_equal_plain_torch(host_device, keep_last_count):
    held = {}

    def inspect(manager, x):
        # between forward and backward: the offloaded inputs are host copies, not the inputs
        held["tracked"] = len(manager._tracker)
        held["kept"] = len(manager._keep_last)
        held["separate"] = all(entry.host.data_ptr() != x.data_ptr() for entry in manager._tracker.values())

    # use_streams asked for, but the host has no streams: the copies run in program order
    manager = get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=True, min_offload_bytes=0,
                                                                  keep_last_count=keep_last_count)
    loss, x_grad, grads = _offloaded(11, manager, inspect)
    ref_loss, ref_x_grad, ref_grads = _reference(11)
    assert torch.allclose(loss, ref_loss)
    assert torch.allclose(x_grad, ref_x_grad, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-6)
    assert manager.use_streams is False
    assert held == {"tracked": 4 - keep_last_count, "kept": keep_last_count, "separate": True}
    assert manager.stats.offloaded_tensors == manager.stats.restored_tensors == 4 - keep_last_count
    assert manager.stats.kept_last_tensors == keep_last_count
    # nothing is left behind once the context ends
    assert not manager._tracker and not manager._keep_last and not manager._restored


def test_restored_view_keeps_its_strides_and_values(host_device):
    base = torch.randn(6, 8)
    x = base[1:, ::2].detach().requires_grad_(True)
    manager = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with manager:
        manager.mark(x)
        loss = checkpoint(lambda t: t.sin().square(), x, use_reentrant=False).sum()
        (entry, ) = manager._tracker.values()
        assert entry.host.is_contiguous() and entry.stride == x.stride()
        restored = manager.restore_input(next(iter(manager._tracker)))
        assert restored.stride() == x.stride() and torch.equal(restored, x.detach())
        assert restored.data_ptr() != x.data_ptr()
    # the id was consumed by restore_input: the graph's own unpack now fails in one line
    with pytest.raises(RuntimeError, match="no longer tracked"):
        loss.backward()


def test_pool_reuses_host_buffers_across_steps(host_device):
    manager = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    seen = []
    for _ in range(2):
        _offloaded(3, manager, lambda m, x: seen.append({e.host.data_ptr() for e in m._tracker.values()}))
    assert len(seen[0]) == 4 and seen[0] == seen[1]


def test_cpu_offloads_nothing_and_grads_still_match():
    manager = CheckpointHiddenStatesOffload(use_streams=True, min_offload_bytes=0, keep_last_count=0)
    loss, x_grad, _ = _offloaded(5, manager)
    ref_loss, ref_x_grad, _ = _reference(5)
    assert torch.allclose(x_grad, ref_x_grad, atol=1e-6)
    assert manager.use_streams is False  # the CPU has no streams
    assert manager.stats.offloaded_tensors == 0 and manager.stats.skipped_marked_tensors == 4


@pytest.mark.parametrize("key", ["keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count",
                                 "min_offload_bytes"])
def test_negative_settings_are_refused_in_one_line(key):
    with pytest.raises(ValueError, match=f"^{key} must be >= 0, got -1$"):
        CheckpointHiddenStatesOffload(**{key: -1})


def test_transformers_marker_marks_hidden_states_and_comes_off(host_device):
    from transformers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, hidden_states):
            return self.linear(hidden_states).sin()

    torch.manual_seed(0)
    layers = nn.ModuleList([Layer() for _ in range(3)])
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    layers.train()
    x = torch.randn(4, 8, requires_grad=True)

    def run():
        h = x
        for layer in layers:
            h = layer(h)
        h.square().sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
        x.grad = None
        layers.zero_grad(set_to_none=True)
        return grads

    before = GradientCheckpointingLayer.__dict__.get("__call__")
    ref = run()
    manager = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with manager:
        assert GradientCheckpointingLayer.__dict__.get("__call__") is not before
        got = run()
    assert GradientCheckpointingLayer.__dict__.get("__call__") is before
    assert manager.stats.marked_tensors == 3 and manager.stats.offloaded_tensors == 3
    assert manager.stats.restored_tensors == 3
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, atol=1e-6)
    # in eval mode (or without gradient checkpointing) nothing is marked
    layers.eval()
    with manager:
        with torch.no_grad():
            h = x
            for layer in layers:
                h = layer(h)
    assert manager.stats.marked_tensors == 0
