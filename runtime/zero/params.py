"""Stage-3 parameter partitioning: shards at rest, gathered around use.

Every partitioned parameter carries a `ZeroParam` (as `param._zero`): its full shape, its
padded chunk size and this rank's shard in the compute dtype. At rest `param.data` is an
empty tensor; `gather` all-gathers the shards of several parameters in one collective
and points `param.data` at the full value; `release` drops it again. Assigning `.data`
keeps the Parameter object (and autograd's references to it) the same, which is what
lets backward re-gather weights that forward released.

Also here: `Init` (build a model directly partitioned) and `GatheredParameters`
(temporary full access, optionally modified on one rank and broadcast).

DeepSpeed's own attributes are kept on each partitioned parameter too, because tools read
them (the Hugging Face Trainer counts parameters with `ds_numel`, since `numel()` of a
parameter at rest is 0): `ds_numel` and `ds_shape` (the full size), `ds_id` (unique in
the process, in partitioning order) and `ds_status` (a ZeroParamStatus, kept current by
gather and release).
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from ..core import comm
from ..core.strict import ConfigError
from .partition import padded_size, param_shard


class ZeroParamStatus(Enum):
    """A partitioned parameter's state, as DeepSpeed's enum of that name (same values)."""

    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # only this rank's shard is here
    INFLIGHT = 3  # being gathered


_next_id = itertools.count()


@dataclass
class ZeroParam:
    name: str
    shape: torch.Size
    numel: int
    chunk: int
    resident: Optional[torch.Tensor]  # this rank's chunk (compute dtype), padded to `chunk` elements;
    # None while it rests in a file (offload_param nvme): read `shard` instead
    persistent: bool = False  # small: kept whole, never released
    master_offset: int = -1  # where the chunk sits in its group's fp32 master partition
    group_index: int = -1
    owner: Optional[object] = field(default=None, repr=False)  # the Stage3 engine, once attached
    swap: Optional[object] = field(default=None, repr=False)  # a ParamSwapper when the shard rests in a file
    group: Optional[object] = field(default=None, repr=False)  # the data-parallel group it is cut over
    world: int = 1  # that group's size and this rank's place in it
    rank: int = 0

    @property
    def shard(self) -> torch.Tensor:
        if self.resident is None:
            self.resident = self.swap.read(self)
        return self.resident

    @shard.setter
    def shard(self, value: torch.Tensor) -> None:
        self.resident = value


def rest(params: Iterable[torch.nn.Parameter], dirty: bool) -> None:
    """Send file-backed shards back to their files (written first when `dirty`)."""
    for p in params:
        z = getattr(p, "_zero", None)
        if z is not None and z.swap is not None:
            z.swap.evict(z, dirty)


def is_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "_zero", None) is not None


def is_present(p: torch.Tensor) -> bool:
    z = p._zero
    return z.persistent or p.data.numel() == z.numel


def partition_param(p: torch.nn.Parameter, name: str = "", persistent: bool = False,
                    device: Optional[torch.device] = None, group=None) -> ZeroParam:
    """Cut `p` over `group` (the default group when None): keep this rank's chunk."""
    world, rank = comm.get_world_size(group), comm.get_rank(group)
    numel = p.numel()
    chunk = padded_size(numel, world) // world
    piece = param_shard(numel, world, rank)
    shard = torch.zeros(chunk, dtype=p.dtype, device=device or p.device)
    shard[:piece.numel].copy_(p.data.reshape(-1)[piece.start:piece.end])
    z = ZeroParam(name, p.shape, numel, chunk, shard, persistent, group=group, world=world, rank=rank)
    p._zero = z
    p.ds_numel, p.ds_shape = numel, p.shape
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_next_id)
    if not persistent:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.ds_status = ZeroParamStatus.AVAILABLE if persistent else ZeroParamStatus.NOT_AVAILABLE
    return z


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


@dataclass
class PendingGather:
    """One all-gather of several parameters' shards, possibly still running (async_op):
    `finish` waits for it and points each parameter's .data at its full value; `discard`
    waits and leaves the parameters at rest (a prefetch that was not needed after all)."""

    params: List[torch.nn.Parameter]
    local: torch.Tensor  # kept alive until the collective is done: it may be the shard itself
    out: torch.Tensor
    work: Optional[object] = None

    @property
    def numel(self) -> int:
        return sum(p._zero.numel for p in self.params)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def finish(self) -> None:
        self.wait()
        rows, off, many = self.out.view(self.params[0]._zero.world, self.local.numel()), 0, len(self.params) > 1
        for p in self.params:
            z = p._zero
            full = rows[:, off:off + z.chunk].reshape(-1)[:z.numel]
            p.data = full.view(z.shape).to(p.dtype).clone() if many else full.view(z.shape)
            p.ds_status = ZeroParamStatus.AVAILABLE
            off += z.chunk

    def discard(self) -> None:
        self.wait()
        for p in self.params:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def start_gather(params: Iterable[torch.nn.Parameter], check=None, what: str = "",
                 async_op: bool = False) -> Optional[PendingGather]:
    """Issue one all-gather for every listed partitioned parameter that is not whole yet
    (shards concatenated per rank); None when there is nothing to gather."""
    need = [p for p in params if is_partitioned(p) and not is_present(p)]
    if not need:
        return None
    group = need[0]._zero.group
    if any(p._zero.group is not group for p in need):
        raise RuntimeError("zero: one gather mixes parameters partitioned over different process groups")
    if check is not None:
        check(f"gather {what}")
    world = need[0]._zero.world
    dtype = need[0]._zero.shard.dtype
    device = need[0].device  # the compute device, even when shards rest in CPU memory (offload_param)
    local = torch.cat([p._zero.shard.to(device, dtype) for p in need]) if len(need) > 1 \
        else need[0]._zero.shard.to(device)
    rest(need, dirty=False)  # `local` keeps a file-backed shard alive until the all-gather is done
    local = local.contiguous()
    out = torch.empty(world * local.numel(), dtype=dtype, device=device)
    work = comm.all_gather_into_tensor(out, local, group=group, label=f"stage3 gather {what}", async_op=async_op)
    for p in need:
        p.ds_status = ZeroParamStatus.INFLIGHT
    return PendingGather(need, local, out, work if async_op else None)


def gather(params: Iterable[torch.nn.Parameter], check=None, what: str = "") -> None:
    """Make every listed partitioned parameter whole, with one all-gather for all the
    ones that are not."""
    pending = start_gather(params, check, what)
    if pending is not None:
        pending.finish()


def release(params: Iterable[torch.nn.Parameter]) -> None:
    for p in params:
        if is_partitioned(p) and not p._zero.persistent and p.data.numel():
            p.data = _empty_like(p)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def refresh_shard_from_full(p: torch.nn.Parameter) -> None:
    """After a full value was written (GatheredParameters modifier, checkpoint load):
    re-cut this rank's shard (and its fp32 master, when an engine owns it)."""
    z = p._zero
    piece = param_shard(z.numel, z.world, z.rank)
    z.shard.zero_()
    z.shard[:piece.numel].copy_(p.data.reshape(-1)[piece.start:piece.end])
    if z.owner is not None:
        z.owner.shard_changed(p)
    rest([p], dirty=True)


class GatheredParameters:
    """`with GatheredParameters(params, modifier_rank=None):` the parameters are whole
    inside the block. With modifier_rank=r, rank r's values when the block ends are
    broadcast to all ranks and become the new shards (and fp32 masters); r is a rank in
    the parameters' data-parallel group (the global rank when that is the world)."""

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if is_partitioned(p)] if enabled else []
        self.modifier_rank = modifier_rank
        self._was_present: List[bool] = []

    def __enter__(self):
        self._was_present = [is_present(p) for p in self.params]
        gather(self.params)
        return self

    def __exit__(self, *exc):
        if exc[0] is None and self.modifier_rank is not None:
            for p in self.params:
                comm.broadcast(p.data, group_src=self.modifier_rank, group=p._zero.group,
                               label=f"GatheredParameters {p._zero.name}")
                refresh_shard_from_full(p)
        release([p for p, was in zip(self.params, self._was_present) if not was])
        return False


class Init:
    """`with Init():` modules constructed inside have their parameters partitioned as
    soon as each module's own __init__ returns, so the whole model never exists on one
    rank. Parameters must be initialised in the constructor that creates them (the
    usual case); code that later rewrites a child's weights should use
    GatheredParameters(..., modifier_rank=0).

    Parameters at most `param_persistence_threshold` elements are kept whole. They are cut
    over `data_parallel_group`, else `mpu.get_data_parallel_group()`, else the world: the
    engine refuses a model cut over another group than its data-parallel one."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True, dtype=None,
                 mpu=None, zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, tensor_overrides=None, *, param_persistence_threshold: Optional[int] = None):
        # DeepSpeed's parameters in DeepSpeed's order. mem_efficient_linear picks DeepSpeed's
        # own linear autograd function, which saves memory its hooks would otherwise keep;
        # here F.linear's default saving already keeps only the input. remote_device/pin_memory
        # place the shards: on a machine without CUDA they are on the CPU already.
        refused = [name for name, value, default in (
            ("zero_param_parallel_group", zero_param_parallel_group, None),
            ("zero_quantized_weights", zero_quantized_weights, False),
            ("zero_quantized_nontrainable_weights", zero_quantized_nontrainable_weights, False),
            ("param_swapper", param_swapper, None)) if value is not default and value != default]
        if refused:
            raise ConfigError(f"zero.Init({refused[0]}=...): not supported (ZeRO++ hierarchical/quantized "
                              "partitioning and custom swappers are not part of dslaunch's ZeRO-3)")
        if remote_device not in (None, "none", "cpu", "nvme"):
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}): expected None, 'cpu' or 'nvme'")
        if remote_device not in (None, "none") and torch.cuda.is_available():
            raise ConfigError(f"zero.Init(remote_device={remote_device!r}) on a CUDA machine: set "
                              "zero_optimization.offload_param.device in the config instead; the engine moves "
                              "the shards there")
        if tensor_overrides not in (None, [], ()):
            names = sorted(str(getattr(t, "name", t)).lower() for t in tensor_overrides)
            if not set(names) <= {"dtype", "device"}:
                raise ConfigError(f"zero.Init(tensor_overrides={names}): expected dtype and/or device")
        self.enabled = enabled
        if data_parallel_group is None:
            data_parallel_group = sequence_data_parallel_group
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = data_parallel_group
        self.threshold = param_persistence_threshold
        if self.threshold is None:
            self.threshold = _threshold_from(config_dict_or_path or config)
        self.dtype = dtype
        self._patched = []
        if module is not None and enabled:
            # DeepSpeed's form for a model built outside the context: partition it now
            self._require_process_group()
            for sub in module.modules():
                self._partition_own(sub)

    @staticmethod
    def _require_process_group() -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("zero.Init() needs torch.distributed initialised first "
                               "(call dslaunch.runtime.init_distributed())")

    def _partition_own(self, module) -> None:
        for name, p in module.named_parameters(recurse=False):
            if not is_partitioned(p):
                if self.dtype is not None and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
                partition_param(p, name=name, persistent=p.numel() <= self.threshold, group=self.group)

    def __enter__(self):
        if not self.enabled:
            return self
        self._require_process_group()
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                orig = cls.__dict__["__init__"]
                cls.__init__ = self._wrap(orig)
                self._patched.append((cls, orig))
        return self

    def _wrap(self, orig):
        init = self

        def __init__(module, *args, **kwargs):
            orig(module, *args, **kwargs)
            init._partition_own(module)
        __init__.__wrapped__ = orig
        return __init__

    def __exit__(self, *exc):
        for cls, orig in reversed(self._patched):
            cls.__init__ = orig
        self._patched.clear()
        return False


def _all_module_classes():
    seen, stack = [], [torch.nn.Module]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.append(c)
        stack.extend(c.__subclasses__())
    return seen


def _threshold_from(config) -> int:
    default = 100_000
    if config is None:
        return default
    if isinstance(config, (str, os.PathLike)):
        from ..strict import load_file  # bounded, regular files only, one-line errors

        config = load_file(os.fspath(config))
    zero = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    value = zero.get("stage3_param_persistence_threshold", default) if isinstance(zero, dict) else default
    # "auto": a Hugging Face placeholder that from_pretrained's zero.Init sees before the Trainer
    # fills it from the model's hidden size (DeepSpeed reads it as unset too).
    return default if value == "auto" else int(value)
