"""RNG states for activation checkpointing, DeepSpeed's `CudaRNGStatesTracker`.

A checkpointed segment runs twice (forward without grad, then again for backward); dropout
must draw the same numbers both times, so the states of every generator the segment may
use are captured before the first run and put back for the second: torch's CPU generator,
the current CUDA device's generator, and every named state in the tracker. Without a GPU
the tracker's states are CPU generator states ("cuda" in the names is DeepSpeed's).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Tuple

import torch

from ...core import comm
from ...tensor_parallel.groups import current_group

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_device_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states: `add(name, seed)` creates one, `fork(name)` runs a block on
    it and keeps its advanced state for the next fork (Megatron's model-parallel dropout)."""

    def __init__(self):
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng tracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        before = _device_state()
        _device_seed(seed)
        self.states_[name] = _device_state()
        _set_device_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"rng tracker: state {name!r} was never added (call add() or "
                             f"model_parallel_cuda_manual_seed first)")
        before = _device_state()
        _set_device_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _device_state()
            _set_device_state(before)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, mpu=None, tp_group=None) -> None:
    """DeepSpeed's (Megatron's) seeding for model parallelism: the default generator gets
    `seed` (the same on every tensor-parallel rank: dropout in replicated regions agrees),
    and the tracker's model-parallel state gets seed + 2718 + the tensor-parallel rank
    (dropout inside sharded regions, under `get_cuda_rng_tracker().fork()`, differs per
    rank). The rank comes from `tp_group`, else `mpu`, else the mpu given to
    deepspeed.checkpointing.configure, else the current group of
    dslaunch.runtime.tensor_parallel (tp_model_init / the engine), else 0. On CPU the
    states are the CPU generator's."""
    tp_rank = _tp_rank(mpu, tp_group)
    _TRACKER.reset()
    _device_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + 2718 + tp_rank)


def model_parallel_reconfigure_tp_seed(seed: int, mpu=None, tp_group=None) -> None:
    with _TRACKER.fork():
        _device_seed(seed + 2718 + _tp_rank(mpu, tp_group))


def _tp_rank(mpu, tp_group=None) -> int:
    if tp_group is not None:
        return comm.get_rank(tp_group)
    if mpu is None:
        from . import checkpointing

        mpu = checkpointing.state.mpu
    if mpu is None:
        current = current_group()
        return current.rank if current is not None else 0
    getter = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank")
    return int(getter())


RngSnapshot = Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]


def snapshot() -> RngSnapshot:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, _TRACKER.get_states()


def restore(snap: RngSnapshot) -> None:
    cpu, cuda, tracked = snap
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    _TRACKER.set_states(tracked)
