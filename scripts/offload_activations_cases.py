"""The cases scripts/make_ds_offload_activations_fixtures.py asks DeepSpeed 0.19.8 and
tests/runtime/train/test_offload_activations_vs_deepspeed.py replays with dslaunch.

Each case runs a tiny checkpointed network on the CPU under CheckpointHiddenStatesOffload and
returns the context's stats (plus the buffer pool's size where a case reuses one context).
`module` is DeepSpeed's offload_activations or ours; `accel` the matching get_accelerator().

On a CPU neither side moves anything (every marked tensor is skipped), so the cases marked
`host_as_device` run with the accelerator answering that the host is an unsynchronised device
that holds every tensor: then the offload logic runs for real (CPU to CPU buffers, no streams,
since the CPU accelerator has none) and its counts can be compared.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

STAT_NAMES = ("saved_tensors_seen", "marked_tensors", "offloaded_tensors", "restored_tensors",
              "skipped_marked_tensors", "kept_last_tensors", "offloaded_bytes", "restored_bytes")


@contextlib.contextmanager
def host_as_device(accel):
    """The accelerator says tensors on the host are on an unsynchronised device, for the block."""
    saved = accel.is_synchronized_device, accel.on_accelerator
    accel.is_synchronized_device = lambda: False
    accel.on_accelerator = lambda tensor: True
    try:
        yield
    finally:
        accel.is_synchronized_device, accel.on_accelerator = saved


def _layers(seed: int, width: int = 16, depth: int = 4) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])


def chain_loss(layers, x, manager=None):
    """Each layer checkpointed (non-reentrant), its input marked first when a manager is given."""
    h = x
    for layer in layers:
        if manager is not None:
            manager.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


def _sin_sq(x):
    return x.sin().square()


def _one_marked(module, x, retain=False, **kw):
    offload = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0, **kw)
    with offload:
        offload.mark(x)
        loss = _sin_sq(checkpoint(_sin_sq, x, use_reentrant=False)).sum()
        if retain:
            loss.backward(retain_graph=True)
            x.grad = None
        loss.backward()
    return offload


def _stats(offload) -> Dict[str, int]:
    return {name: getattr(offload.stats, name) for name in STAT_NAMES}


def case_unmarked(module):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    linear = nn.Linear(8, 8)
    offload = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0)
    with offload:
        linear(x).square().sum().backward()
    return _stats(offload)


def case_chain(module, keep_last_count, min_offload_bytes=0):
    layers = _layers(3)
    x = torch.randn(8, 16, requires_grad=True)
    offload = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=min_offload_bytes,
                                                   keep_last_count=keep_last_count)
    with offload:
        chain_loss(layers, x, offload).backward()
    return _stats(offload)


def case_two_steps(module):
    """One context entered twice: the second step's buffers come from the pool the first filled."""
    layers = _layers(5)
    x = torch.randn(8, 16, requires_grad=True)
    offload = module.CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=1,
                                                   max_cpu_buffer_pool_count=2)
    out = []
    for _ in range(2):
        with offload:
            chain_loss(layers, x, offload).backward()
        out.append(dict(_stats(offload), pool=offload._cpu_buffer_pool_count))
    return out


def case_views(module):
    torch.manual_seed(7)
    base = torch.randn(6, 8)
    return {"offset": _stats(_one_marked(module, base[2:].detach().requires_grad_(True))),
            "strided": _stats(_one_marked(module, base[:, ::2].detach().requires_grad_(True))),
            "overlapping": _stats(_one_marked(module, base[:4].expand(2, 4, 8).detach().requires_grad_(True))),
            "retain_graph": _stats(_one_marked(module, torch.randn(4, 8, requires_grad=True), retain=True))}


def run_all(module, accel):
    """Every case: on the plain CPU, then with the host standing in for a device."""
    result = {"cpu": {"unmarked": case_unmarked(module),
                      **{f"chain-k{k}": case_chain(module, k) for k in (0, 1)}}}
    with host_as_device(accel):
        result["host_as_device"] = {
            "unmarked": case_unmarked(module),
            **{f"chain-k{k}": case_chain(module, k) for k in (0, 1, 2, 5)},
            # 8x16 fp32 inputs are 512 bytes: a 1024-byte threshold skips them all
            "chain-min1024": case_chain(module, 0, min_offload_bytes=1024),
            "two-steps": case_two_steps(module),
            **case_views(module)}
    return result
