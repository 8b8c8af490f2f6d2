"""Moving ZeRO's states off the accelerator and back on demand (engine.offload_states /
engine.reload_states, DeepSpeed's names): RLHF loops free the training engine's memory while
another model generates, then bring it back before the next step.

A state is moved by swapping each tensor's `.data` for a copy on the target device, so the
tensor objects themselves (the optimizer's state values, its param_groups' partitions, the
keys of optimizer.state) stay the same; the strategy then re-seats any views that shared
the moved storage (stage 1/2's parameters are views into a flat buffer). Each moved tensor
remembers the device it came from, and reload_states puts every one back there: the values
are copies, so a round trip is bit-exact.

`pin_memory` asks for page-locked host copies (only meaningful when the tensor is on an
accelerator: torch cannot pin without one, and a host tensor moved to the host is not
copied at all). With `non_blocking` the copies are queued on the current stream and the
caller synchronizes before reading the moved tensors from another stream or the host,
as with torch's own `.to(non_blocking=True)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set

import torch

from ..core.config.zero import OffloadDeviceEnum, OffloadStateTypeEnum


class OffloadStatesError(ValueError):
    """A request offload_states cannot honour (stage, device, offloaded parameters)."""


def _must_move(t: torch.Tensor, device: torch.device) -> bool:
    return t.device != device


def _copy_back(t: torch.Tensor, home: torch.device, non_blocking: bool) -> torch.Tensor:
    return t.data.to(home, non_blocking=non_blocking)


def _copy_to(t: torch.Tensor, device: torch.device, pin: bool, non_blocking: bool) -> torch.Tensor:
    if pin and device.type == "cpu" and t.device.type != "cpu" and torch.cuda.is_available():
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=non_blocking)
        return host
    return t.data.to(device, non_blocking=non_blocking)


@dataclass
class _Moved:
    tensor: torch.Tensor
    home: torch.device  # where reload puts it back


@dataclass
class StateMover:
    """What offload_states moved and from where: one record per tensor (a tensor that two
    kinds share, such as a master that is also the parameter's storage, moves once)."""

    moved: Dict[int, _Moved] = field(default_factory=dict)
    kinds: Set[OffloadStateTypeEnum] = field(default_factory=set)

    def offload(self, kind: OffloadStateTypeEnum, tensors: Iterable[torch.Tensor], device: torch.device,
                pin: bool, non_blocking: bool) -> None:
        for t in tensors:
            if id(t) in self.moved:
                continue
            self.moved[id(t)] = _Moved(t, t.device)
            if _must_move(t, device):
                t.data = _copy_to(t, device, pin, non_blocking)
        self.kinds.add(kind)

    def reload(self, non_blocking: bool) -> None:
        for m in self.moved.values():
            if _must_move(m.tensor, m.home):
                m.tensor.data = _copy_back(m.tensor, m.home, non_blocking)
        self.moved.clear()
        self.kinds.clear()


def resolve_include(include: Optional[Sequence], optimizer_on_host: bool, stage: int) -> List[OffloadStateTypeEnum]:
    """The kinds to move: every kind when `include` is None. With offload_optimizer the masters
    and optimizer state (and, at stage 3, the gradient partitions) already live in host
    memory and are left where they are, as DeepSpeed does."""
    known = {k.value: k for k in OffloadStateTypeEnum}
    if include is None:
        kinds = list(OffloadStateTypeEnum)
    else:
        unknown = [k for k in include if getattr(k, "value", k) not in known]
        if unknown:
            raise OffloadStatesError(f"offload_states: include names {unknown!r}, which are not states; the states are "
                                     f"{', '.join(known)}")
        kinds = [known[getattr(k, "value", k)] for k in include]
    if optimizer_on_host:
        resident = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
        if stage == 3:
            resident.add(OffloadStateTypeEnum.lp_grads)
        kinds = [k for k in kinds if k not in resident]
    return kinds


def target_device(device) -> Optional[torch.device]:
    """The device offload_states moves to; None for "none" (nothing to do). NVMe is refused:
    the states are moved as tensors, not swapped to files."""
    name = device.value if isinstance(device, OffloadDeviceEnum) else str(device)
    if name == OffloadDeviceEnum.none.value:
        return None
    if name == OffloadDeviceEnum.nvme.value:
        raise OffloadStatesError("offload_states: device nvme is not supported (states move to host memory only; "
                                 "use device=OffloadDeviceEnum.cpu)")
    if name != OffloadDeviceEnum.cpu.value:
        raise OffloadStatesError(f"offload_states: device {name!r} is not one of none, cpu")
    return torch.device("cpu")


def offload_strategy_states(strategy, include, device, pin_memory: bool, non_blocking: bool) -> None:
    """engine.offload_states: `strategy` is a ZeRO stage 1-3 strategy (state_tensors(kind),
    reseat_states(), optimizer_on_host, mover)."""
    check_movable(strategy)
    target = target_device(device)
    if target is None:
        return
    for kind in resolve_include(include, strategy.optimizer_on_host, strategy.stage):
        strategy.mover.offload(kind, strategy.state_tensors(kind), target, pin_memory, non_blocking)
    strategy.reseat_states()


def reload_strategy_states(strategy, non_blocking: bool) -> None:
    check_movable(strategy)
    strategy.mover.reload(non_blocking)
    strategy.reseat_states()


def check_movable(strategy) -> None:
    if not hasattr(strategy, "state_tensors"):
        raise OffloadStatesError("offload_states/reload_states: the engine's states are not partitioned; they need "
                                 "zero_optimization.stage 1, 2 or 3")
    if strategy.optimizer is None:
        raise OffloadStatesError("offload_states/reload_states: the engine has no optimizer (ZeRO inference): "
                                 "there are no training states to move")
    if getattr(strategy, "param_device", None) is not None:
        raise OffloadStatesError("offload_states/reload_states: not supported with zero_optimization.offload_param "
                                 "(the parameters already live in host memory or files)")


def get_state_devices(model, state: OffloadStateTypeEnum) -> Set[torch.device]:
    """The devices the engine's tensors of kind `state` are on now (an empty set when the
    engine holds none of that kind, e.g. gradient partitions between steps)."""
    strategy = getattr(model, "strategy", None)
    check_movable(strategy)
    return {t.device for t in strategy.state_tensors(OffloadStateTypeEnum(state))}

