"""Where the optimizer update of the fp32 partitions runs.

`InPlaceHost`: the user's optimizer steps the partitions where they are (no offload).
`CPUHost`: offload_optimizer.device == "cpu": partitions and state live in host memory;
   the optimizer's fused CPU step (dslaunch.kernels.fused_step: CPUAdam/CPULion/CPUAdagrad,
   and torch's own Adam/AdamW/Adagrad) runs the update when it has one, otherwise the
   optimizer's own step() does (warned once, with the reason).
`NVMeHost`: offload_optimizer.device == "nvme": optimizer state tensors live in files
   under nvme_path between steps; a background thread reads group i+1's state while
   group i is updated, and another writes group i back while i+1 is updated.
"""
from __future__ import annotations

import os
import threading
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ..core.comm import shutdown

_warned = False


@dataclass
class StateKey:
    name: str
    tensor: bool
    value: Any = None


def _is_partitioned(key: str, v, master: torch.Tensor) -> bool:
    return torch.is_tensor(v) and key != "step" and v.shape == master.shape


class OptimizerHost:
    def __init__(self, optimizer: torch.optim.Optimizer, masters: List[torch.Tensor]):
        self.optimizer, self.masters = optimizer, masters

    def step(self) -> None:
        self.optimizer.step()

    def state_of(self, gi: int) -> Dict[str, Any]:
        return dict(self.optimizer.state.get(self.masters[gi], {}))

    def state_keys(self, gi: int, shards: List[Dict[str, Any]]) -> List[StateKey]:
        keys = {}
        for sh in shards:
            if gi >= len(sh["groups"]):
                continue
            for k, v in sh["groups"][gi]["state"].items():
                keys[k] = StateKey(k, True) if isinstance(v, dict) else StateKey(k, False, v)
        return list(keys.values())

    def write_state_of(self, gi: int, state: Dict[str, Any]) -> None:
        """After tensors of `state_of(gi)` were changed in place: keep the change. Here they
        are the optimizer's own tensors already; NVMeHost writes its files."""

    def load_state_of(self, gi: int, state: Dict[str, Any]) -> None:
        m = self.masters[gi]
        self.optimizer.state[m] = {k: (v.to(m.device) if torch.is_tensor(v) and k != "step" else
                                       (v.clone() if torch.is_tensor(v) else v))
                                   for k, v in state.items()}

    def close(self) -> None:
        pass


class CPUHost(OptimizerHost):
    """Masters are already in host memory (the partition builder put them there); the
    fused kernel steps them when it can."""

    def __init__(self, optimizer, masters):
        super().__init__(optimizer, masters)
        self.kernel = _fused_cpu_step(optimizer)

    def step(self) -> None:
        if self.kernel is None:
            self.optimizer.step()
            return
        for pg, m in zip(self.optimizer.param_groups, self.masters):
            st = self.optimizer.state.setdefault(m, {})
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st.update(self.kernel.init_state(m, pg))
            st["step"] += 1
            self.kernel.step(m, m.grad, st, int(st["step"]), pg)


def _fused_cpu_step(optimizer):
    """The optimizer's fused CPU step (dslaunch.kernels.fused_step), or None with a one-time
    warning saying why the optimizer's own step() runs instead."""
    global _warned
    from dslaunch.kernels.fused_step import FusedStepUnavailable, fused_cpu_step

    try:
        return fused_cpu_step(optimizer)
    except FusedStepUnavailable as exc:
        if not _warned:
            warnings.warn(f"offload_optimizer: {type(optimizer).__name__}.step() runs on the CPU without a fused "
                          f"kernel: {exc}", stacklevel=3)
            _warned = True
        return None


class NVMeHost(OptimizerHost):
    """Optimizer state swapped to files under nvme_path.

    With the fused CPU Adam (Adam/AdamW), each group's partition is cut into chunks of
    `sub_group_size` elements; chunk k+1's state is read by a background thread while
    chunk k is updated, and chunk k is written back by another thread while k+1 is
    updated, so at most three chunks of state are in memory. Other optimizers swap whole
    param groups the same way and step them with the user's optimizer."""

    def __init__(self, optimizer, masters, nvme_path: str, sub_group_size: int = 1_000_000_000):
        super().__init__(optimizer, masters)
        self.kernel = _fused_cpu_step(optimizer)
        chunk = max(1, int(sub_group_size)) if self.kernel is not None else None
        self.units = [(gi, a, min(a + chunk, m.numel()) if chunk else m.numel())
                      for gi, m in enumerate(masters) for a in (range(0, m.numel(), chunk) if chunk else [0])]
        self.steps = [0] * len(masters)
        self.dir = os.path.join(nvme_path, f"dslaunch-swap-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(self.dir, exist_ok=True)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-read")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")
        self.pending_writes: Dict[int, Future] = {}
        self.on_disk = [False] * len(self.units)
        self.bytes_read = 0
        self.bytes_written = 0
        shutdown.register_owner(self.close)  # at exit: writes flushed, threads stopped, files removed

    def _path(self, ui: int) -> str:
        return os.path.join(self.dir, f"unit{ui}.pt")

    def _read(self, ui: int) -> Dict[str, Any]:
        fut = self.pending_writes.pop(ui, None)
        if fut is not None:
            fut.result()
        if not self.on_disk[ui]:
            return {}
        state = torch.load(self._path(ui), map_location="cpu", weights_only=True)
        self.bytes_read += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        return state

    def _write(self, ui: int, state: Dict[str, Any]) -> None:
        tmp = self._path(ui) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self._path(ui))
        self.bytes_written += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        self.on_disk[ui] = True

    def step(self) -> None:
        if not self.units:
            return
        groups = self.optimizer.param_groups
        if self.kernel is not None:
            for gi in range(len(self.masters)):
                self.steps[gi] += 1
        grads = [m.grad for m in self.masters]
        nxt = self.reader.submit(self._read, 0)
        for ui, (gi, a, b) in enumerate(self.units):
            state = nxt.result()
            nxt = self.reader.submit(self._read, ui + 1) if ui + 1 < len(self.units) else None
            m = self.masters[gi]
            if self.kernel is not None:
                if not state:
                    state = self.kernel.init_state(m[a:b], groups[gi])
                self.kernel.step(m[a:b], grads[gi][a:b], state, self.steps[gi], groups[gi])
                out = state
            else:
                if state:
                    self.optimizer.state[m] = state
                for j, mm in enumerate(self.masters):  # step only this group
                    mm.grad = grads[j] if j == gi else None
                self.optimizer.step()
                out = self.optimizer.state.pop(m, {})
            self.pending_writes[ui] = self.writer.submit(self._write, ui, out)
        for j, mm in enumerate(self.masters):
            mm.grad = grads[j]

    def flush(self) -> None:
        for fut in list(self.pending_writes.values()):
            fut.result()
        self.pending_writes.clear()

    def state_of(self, gi: int) -> Dict[str, Any]:
        self.flush()
        mine = [(ui, a, b) for ui, (g, a, b) in enumerate(self.units) if g == gi]
        if self.kernel is None:
            return self._read(mine[0][0]) if mine else {}
        if not any(self.on_disk[ui] for ui, _, _ in mine):
            return {}
        m = self.masters[gi]
        out = {"step": torch.tensor(float(self.steps[gi])),
               **self.kernel.init_state(m, self.optimizer.param_groups[gi])}
        for ui, a, b in mine:
            st = self._read(ui)
            for k in out:
                if k != "step" and k in st:
                    out[k][a:b] = st[k]
        return out

    def write_state_of(self, gi: int, state: Dict[str, Any]) -> None:
        self.load_state_of(gi, state)  # state_of read copies from the files: write them back

    def load_state_of(self, gi: int, state: Dict[str, Any]) -> None:
        self.flush()
        mine = [(ui, a, b) for ui, (g, a, b) in enumerate(self.units) if g == gi]
        if self.kernel is None:
            for ui, _, _ in mine:
                self._write(ui, {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()})
            return
        self.steps[gi] = int(float(state.get("step", 0)))
        m = self.masters[gi]
        for ui, a, b in mine:
            self._write(ui, {k: v[a:b].clone() for k, v in state.items() if _is_partitioned(k, v, m)})

    def close(self) -> None:
        self.flush()
        self.reader.shutdown()
        self.writer.shutdown()
        remove_swap_files([self._path(ui) for ui in range(len(self.units))], self.dir)


def remove_swap_files(paths, folder: str) -> None:
    """Delete a swapper's files and then its folder (left in place if something else lives there)."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        pass


def pin_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """`pin_memory: true`: page-locked host buffers, so copies between them and the GPU can
    run asynchronously. Without CUDA there is no device to copy to and torch cannot pin,
    so the option is then a no-op and `t` comes back as it is."""
    if pin and t.device.type == "cpu" and torch.cuda.is_available():
        return t.pin_memory()
    return t


def make_host(optimizer, masters, offload, sub_group_size: int = 1_000_000_000) -> OptimizerHost:
    device = getattr(offload, "device", "none") if offload is not None else "none"
    if device == "cpu":
        return CPUHost(optimizer, masters)
    if device == "nvme":
        return NVMeHost(optimizer, masters, offload.nvme_path, sub_group_size)
    return OptimizerHost(optimizer, masters)
