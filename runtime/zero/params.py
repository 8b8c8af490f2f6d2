"""Stage-3 parameter partitioning: shards at rest, gathered around use.

Every partitioned parameter carries a `ZeroParam` (as `param._zero`): its full shape, its
padded chunk size and this rank's shard in the compute dtype. At rest `param.data` is an
empty tensor; `gather` all-gathers the shards of several parameters in one collective
and points `param.data` at the full value; `release` drops it again. Assigning `.data`
keeps the Parameter object (and autograd's references to it) the same, which is what
lets backward re-gather weights that forward released.

Also here: `Init` (build a model directly partitioned) and `GatheredParameters`
(temporary full access, optionally modified on one rank and broadcast).

ZeRO++ (zeropp.py) changes what the training gathers (`training=True`: the engine's hooks and
prefetches) send: int8 blocks (qwZ, `ZeroParam.quantize`), the shards of frozen weights kept
as int8 (`ZeroParam.packed`), and, once a parameter has a second shard inside the host (hpZ,
`ZeroParam.secondary`), a gather over the host's ranks instead of all of them. One gather
call may then be several collectives ("legs"), one per kind. Full-value gathers
(checkpoints, GatheredParameters) always read the exact primary shards.

DeepSpeed's own attributes are kept on each partitioned parameter too, because tools read
them (the Hugging Face Trainer counts parameters with `ds_numel`, since `numel()` of a
parameter at rest is 0): `ds_numel` and `ds_shape` (the full size), `ds_id` (unique in
the process, in partitioning order), `ds_status` (a ZeroParamStatus, kept current by
gather and release), `ds_persist` (kept whole throughout) and `ds_tensor` (this rank's
partition: the shard itself, republished whenever the shard is replaced); and DeepSpeed's
methods `all_gather`, `all_gather_coalesced` and `partition`, which gather and release too.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import weakref
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist

from ..core import comm
from ..core.autocast import get_comm_dtype, has_comm_dtype
from ..core.module_cast import CASTABLE, cast_module, keep_in_fp32_pattern
from ..core.strict import ConfigError
from .init_dtype import CreateInDtype, paused
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
    # this rank's chunk (compute dtype), padded to `chunk` elements; None while it rests in a file
    # (offload_param nvme) or is kept as int8 blocks: read `shard` instead. Set through `resident`,
    # which also republishes it as the parameter's `ds_tensor`.
    _resident: Optional[torch.Tensor]
    persistent: bool = False  # small: kept whole, released only by engine.empty_partition_cache
    master_offset: int = -1  # where the chunk sits in its group's fp32 master partition
    group_index: int = -1
    owner: Optional[object] = field(default=None, repr=False)  # the Stage3 engine, once attached
    swap: Optional[object] = field(default=None, repr=False)  # a ParamSwapper when the shard rests in a file
    group: Optional[object] = field(default=None, repr=False)  # the data-parallel group it is cut over
    world: int = 1  # that group's size and this rank's place in it
    rank: int = 0
    # ZeRO++ (zeropp.py): the engine's ZeroPP (None: off); qwZ for this parameter's training
    # gathers; its shard kept as int8 blocks (frozen weights; then `resident` is None); its hpZ
    # second shard (None: none valid)
    zeropp: Optional[object] = field(default=None, repr=False)
    quantize: bool = False
    packed: Optional[object] = field(default=None, repr=False)
    secondary: Optional[object] = field(default=None, repr=False)
    param: Optional[weakref.ref] = field(default=None, repr=False)  # the parameter this describes

    @property
    def resident(self) -> Optional[torch.Tensor]:
        return self._resident

    @resident.setter
    def resident(self, value: Optional[torch.Tensor]) -> None:
        self._resident = value
        p = self.param() if self.param is not None else None
        if p is not None:
            publish_ds_tensor(p, self)

    @property
    def shard(self) -> torch.Tensor:
        """This rank's chunk. A packed shard comes back dequantized, a fresh tensor: write a new
        value with `z.shard = value`, never in place."""
        if self.packed is not None:
            return self.packed.values()
        if self.resident is None:
            self.resident = self.swap.read(self)
        return self.resident

    @shard.setter
    def shard(self, value: torch.Tensor) -> None:
        if self.packed is not None:
            self.packed = type(self.packed).of(value)
            self.secondary = None
            return
        self.resident = value

    @property
    def shard_device(self) -> torch.device:
        if self.packed is not None:
            return self.packed.q.device
        return self.resident.device if self.resident is not None else torch.device("cpu")

    def written(self) -> None:
        """The value changed: a second shard (hpZ) cut from the old one is no longer valid."""
        self.secondary = None


def publish_ds_tensor(p: torch.nn.Parameter, z: ZeroParam) -> None:
    """DeepSpeed's `param.ds_tensor`: this rank's partition, a flat tensor of
    ceil(numel / world) elements (the last rank's tail is padding), here the very tensor the
    engine gathers from and the step writes (so it never goes stale: every change of the shard
    goes through `ZeroParam.resident`, which calls this). Like DeepSpeed's, it carries its
    `ds_numel` (the partition's size). None while no float partition is held in memory: the shard
    rests in a file (offload_param nvme) or is kept as int8 blocks (ZeRO++ frozen weights)."""
    t = z.resident
    if t is not None:
        t.ds_numel = z.chunk
    p.ds_tensor = t


def pack_shard(z: ZeroParam) -> None:
    """Keep z's shard as qwZ's int8 blocks from now on (a frozen weight under
    zero_quantized_nontrainable_weights): the float shard is dropped."""
    from .zeropp import Packed

    if z.packed is None:
        z.packed = Packed.of(z.shard)
        z.resident = None
        z.swap = None
        z.secondary = None


def rest(params: Iterable[torch.nn.Parameter], dirty: bool) -> None:
    """Send file-backed shards back to their files (written first when `dirty`)."""
    for p in params:
        z = getattr(p, "_zero", None)
        if z is not None and z.swap is not None:
            z.swap.evict(z, dirty)


def is_partitioned(p: torch.Tensor) -> bool:
    return getattr(p, "_zero", None) is not None


def is_present(p: torch.Tensor) -> bool:
    """Whether the whole parameter is in p.data (a persistent one is, unless
    engine.empty_partition_cache released it: then the next use gathers it again)."""
    return p.data.numel() == p._zero.numel


class _DsSummary:
    """`param.ds_summary()`: DeepSpeed's one-dict account of a partitioned parameter, which its
    tests print when a status check fails. Holds the parameter weakly (no cycle through it)."""

    def __init__(self, p: torch.nn.Parameter):
        self._param = weakref.ref(p)

    def __call__(self, use_debug_name: bool = False) -> dict:
        p = self._param()
        if p is None:
            return {}
        z = p._zero
        t = getattr(p, "ds_tensor", None)
        return {"id": z.name if use_debug_name and z.name else p.ds_id, "status": p.ds_status.name,
                "numel": p.numel(), "ds_numel": p.ds_numel, "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape),
                "requires_grad": p.requires_grad, "grad_shape": tuple(p.grad.shape) if p.grad is not None else None,
                "persist": p.ds_persist, "ds_tensor.shape": t.shape if t is not None else None}


class _CoalescedGather:
    """The handle `param.all_gather_coalesced(params)` returns: `wait()` finishes the gather (the
    parameters whole and AVAILABLE), as DeepSpeed's AllGatherCoalescedHandle does."""

    def __init__(self, pending: Optional["PendingGather"]):
        self._pending = pending

    def wait(self, handle_dependency: bool = True) -> None:
        if self._pending is not None:
            self._pending.finish()
            self._pending = None


# DeepSpeed's methods on a partitioned parameter, which scripts and its tests call on any one of
# them for a list (`params[0].all_gather_coalesced(params)`). Collective like their DeepSpeed
# originals (every rank calls them with the same list). Each is bound to its parameter through a
# weak reference (partition_param), so the parameter holds no cycle through itself.
def _listed(ref, param_list) -> list:
    return [ref()] if param_list is None else list(param_list)


def _param_all_gather(ref, param_list=None, async_op: bool = False, hierarchy=None):
    handle = _CoalescedGather(start_gather(_listed(ref, param_list), what="param.all_gather", async_op=async_op))
    if not async_op:
        handle.wait()
        return None
    return handle


def _param_all_gather_coalesced(ref, params, safe_mode: bool = False, quantize: bool = False):
    return _CoalescedGather(start_gather(list(params), what="param.all_gather_coalesced", async_op=True))


def _param_partition(ref, param_list=None, hierarchy=None, has_been_updated: bool = False, free_data: bool = True):
    # has_been_updated: the whole value was written, so each shard is cut from it again first
    params = [q for q in _listed(ref, param_list) if is_partitioned(q) and is_present(q)]
    if has_been_updated:
        for q in params:
            refresh_shard_from_full(q)
    release(params)


_PARAM_METHODS = {"all_gather": _param_all_gather, "all_gather_coalesced": _param_all_gather_coalesced,
                  "partition": _param_partition}


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
    z.param = weakref.ref(p)
    publish_ds_tensor(p, z)
    p.ds_numel, p.ds_shape = numel, p.shape
    # DeepSpeed's flag for a parameter kept whole through training (never released): its tests
    # skip those when they check that the others are released after backward
    p.ds_persist = persistent
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_next_id)
    p.ds_summary = _DsSummary(p)
    # the ds_ids of the modules whose hooks gathered it since it was last released (a persistent
    # one is whole throughout, so no module holds it): DeepSpeed's name, its tests read it
    p.ds_active_sub_modules = set()
    # DeepSpeed's mark of a parameter a module's forward returned (stage3._handed_out)
    if not hasattr(p, "is_external_param"):
        p.is_external_param = False
    ref = weakref.ref(p)
    for name, method in _PARAM_METHODS.items():
        setattr(p, name, functools.partial(method, ref))
    if not persistent:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    p.ds_status = ZeroParamStatus.AVAILABLE if persistent else ZeroParamStatus.NOT_AVAILABLE
    return z


def get_allgather_dtype(param: torch.Tensor, param_ds_tensor: torch.Tensor) -> torch.dtype:
    """DeepSpeed's answer to which dtype `param` travels in when stage 3 gathers it: its
    autocast communication dtype when torch_autocast marked it, else its shard's
    (`param_ds_tensor`, DeepSpeed's name) dtype. dslaunch marks no parameter (core/autocast.py),
    so here it is the shard's dtype, the dtype start_gather's plain leg carries."""
    return get_comm_dtype(param) if has_comm_dtype(param) else param_ds_tensor.dtype


def _empty_like(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


class _Leg:
    """One collective of a gather: the parameters it carries and, once done, each one's
    padded full value (rows x width elements, flat)."""

    def __init__(self, params, rows: int, widths: List[int]):
        self.params, self.rows, self.widths = params, rows, widths

    def wait(self) -> None:
        raise NotImplementedError

    def fulls(self) -> List[torch.Tensor]:
        raise NotImplementedError

    def _split(self, rows_view: torch.Tensor) -> List[torch.Tensor]:
        out, off = [], 0
        for w in self.widths:
            out.append(rows_view[:, off:off + w].reshape(-1))
            off += w
        return out


class _PlainLeg(_Leg):
    """The shards as they are (the compute dtype), in one all-gather."""

    def __init__(self, params, sources, group, rows, widths, dtype, device, label, async_op):
        super().__init__(params, rows, widths)
        self.local = torch.cat([t.to(device, dtype) for t in sources]) if len(sources) > 1 \
            else sources[0].to(device, dtype)
        self.local = self.local.contiguous()
        self.out = torch.empty(rows * self.local.numel(), dtype=dtype, device=device)
        self.work = comm.all_gather_into_tensor(self.out, self.local, group=group, label=label, async_op=async_op)

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def fulls(self) -> List[torch.Tensor]:
        self.wait()
        return self._split(self.out.view(self.rows, -1))


class _QuantLeg(_Leg):
    """qwZ: the shards as int8 blocks (zeropp.QuantizedAllGather)."""

    def __init__(self, params, sources, group, rows, widths, dtype, device, label, async_op):
        from .zeropp import QuantizedAllGather

        super().__init__(params, rows, widths)
        local = torch.cat([t.to(device) for t in sources]) if len(sources) > 1 else sources[0].to(device)
        self.gather = QuantizedAllGather(local, group, rows, dtype, label, async_op)

    def wait(self) -> None:
        self.gather.wait()

    def fulls(self) -> List[torch.Tensor]:
        return self._split(self.gather.values())


class _PackedLeg(_Leg):
    """Shards kept as int8 blocks (frozen weights), gathered as they are."""

    def __init__(self, params, sources, group, rows, widths, dtype, device, label, async_op):
        from .zeropp import PackedAllGather

        super().__init__(params, rows, widths)
        self.gather = PackedAllGather(sources, group, rows, device, label, async_op)

    def wait(self) -> None:
        self.gather.wait()

    def fulls(self) -> List[torch.Tensor]:
        return [torch.cat(self.gather.rows_of(i)) for i in range(len(self.params))]


@dataclass
class PendingGather:
    """One gather of several parameters (one or more collectives, possibly still running:
    async_op): `finish` waits and points each parameter's .data at its full value; `discard`
    waits and leaves the parameters at rest (a prefetch that was not needed after all)."""

    params: List[torch.nn.Parameter]
    legs: List[_Leg]

    @property
    def numel(self) -> int:
        return sum(p._zero.numel for p in self.params)

    def wait(self) -> None:
        for leg in self.legs:
            leg.wait()

    def finish(self) -> None:
        for leg in self.legs:
            fulls = leg.fulls()
            many = len(leg.params) > 1
            for p, full in zip(leg.params, fulls):
                z = p._zero
                full = full[:z.numel]
                p.data = full.view(z.shape).to(p.dtype).clone() if many else full.view(z.shape).to(p.dtype)
                p.ds_status = ZeroParamStatus.AVAILABLE

    def discard(self) -> None:
        self.wait()
        for p in self.params:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


class MultipleAllGatherHandles:
    """Several gather handles waited as one (DeepSpeed's name, which ZeRO-3 hook code and its
    tests build from per-bucket handles): `wait(handle_dependency=...)` waits each handle in
    order, passing handle_dependency by keyword so that handles whose wait takes it
    keyword-only, or as **kwargs, receive it too."""

    def __init__(self, handles) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


# The shape of a partitioned parameter's .data at rest (an empty tensor), DeepSpeed's
# module-level name for it: code checks `p.shape == torch.Size(partitioned_param_data_shape)`.
partitioned_param_data_shape = [0]


def _source(p, training: bool):
    """(kind, group, rows, width, source) of p's next gather: its hpZ second shard when it has
    a valid one and this is a training gather, else its primary shard; the kind says how the
    bytes travel ("plain", "quant": qwZ, "packed": kept as int8)."""
    z = p._zero
    pp = z.zeropp
    if training and pp is not None and z.secondary is not None:
        kind = "packed" if z.packed is not None else ("quant" if z.quantize else "plain")
        return kind, pp.hpz_group, pp.hpz, pp.secondary_width(z.chunk), z.secondary
    if z.packed is not None:
        return "packed", z.group, z.world, z.chunk, z.packed
    # one rank gathers nothing: nothing to quantize (DeepSpeed does not gather then either)
    return ("quant" if training and z.quantize and z.world > 1 else "plain"), z.group, z.world, z.chunk, None


_LEGS = {"plain": _PlainLeg, "quant": _QuantLeg, "packed": _PackedLeg}


def start_gather(params: Iterable[torch.nn.Parameter], check=None, what: str = "",
                 async_op: bool = False, training: bool = False) -> Optional[PendingGather]:
    """Issue the all-gathers for every listed partitioned parameter that is not whole yet
    (shards concatenated per rank; one collective per kind of source, see `_source`);
    None when there is nothing to gather. `training`: a gather of the engine's hooks, which
    ZeRO++ may quantize or keep inside the host."""
    need = [p for p in params if is_partitioned(p) and not is_present(p)]
    if not need:
        return None
    group = need[0]._zero.group
    if any(p._zero.group is not group for p in need):
        raise RuntimeError("zero: one gather mixes parameters partitioned over different process groups")
    if check is not None:
        check(f"gather {what}")
    device = need[0].device  # the compute device, even when shards rest in CPU memory (offload_param)
    kinds: dict = {}
    for p in need:
        kind, grp, rows, width, src = _source(p, training)
        # one collective per dtype too: a float32 adapter gathered with bfloat16 weights keeps its precision
        key = (kind, id(grp), rows, p.dtype)
        if key not in kinds:
            kinds[key] = (grp, rows, [], [], [])
        entry = kinds[key]
        entry[2].append(p)
        entry[3].append(width)
        entry[4].append(src if src is not None else p._zero.shard)
    legs = []
    for (kind, _, rows, dtype), (grp, _, ps, widths, sources) in kinds.items():
        where = "" if rows == need[0]._zero.world else " inside the host"
        legs.append(_LEGS[kind](ps, sources, grp, rows, widths, dtype, device, f"stage3 gather {what}{where}",
                                async_op))
    rest(need, dirty=False)  # the legs keep file-backed shards alive until their collectives are done
    for p in need:
        p.ds_status = ZeroParamStatus.INFLIGHT
    return PendingGather([p for leg in legs for p in leg.params], legs)


def gather(params: Iterable[torch.nn.Parameter], check=None, what: str = "", training: bool = False) -> None:
    """Make every listed partitioned parameter whole, with one all-gather (per kind of
    source, see start_gather) for all the ones that are not."""
    pending = start_gather(params, check, what, training=training)
    if pending is not None:
        pending.finish()


def keep_whole(params: Iterable[torch.nn.Parameter]) -> None:
    """Make cut parameters persistent: gathered now (collective, the same list on every rank) and
    never released again; their shards stay as they are."""
    params = [p for p in params if not p._zero.persistent]
    gather(params)
    for p in params:
        p._zero.persistent = True
        p.ds_persist = True
        p.ds_status = ZeroParamStatus.AVAILABLE


def release(params: Iterable[torch.nn.Parameter], persistent: bool = False) -> None:
    """Free the whole copies of these parameters (persistent ones only when `persistent`)."""
    for p in params:
        if is_partitioned(p) and (persistent or not p._zero.persistent) and p.data.numel():
            z = p._zero
            if z.zeropp is not None and z.zeropp.hpz > 1 and z.secondary is None:
                z.zeropp.keep_secondary(p)  # hpZ: the next gathers stay inside the host
            p.data = _empty_like(p)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            p.ds_active_sub_modules.clear()


def refresh_shard_from_full(p: torch.nn.Parameter) -> None:
    """After a full value was written (GatheredParameters modifier, checkpoint load):
    re-cut this rank's shard (and its fp32 master, when an engine owns it)."""
    z = p._zero
    piece = param_shard(z.numel, z.world, z.rank)
    if z.packed is not None:  # kept as int8 blocks: quantized again from the new value
        new = torch.zeros(z.chunk, dtype=p.dtype, device=z.shard_device)
        new[:piece.numel].copy_(p.data.reshape(-1)[piece.start:piece.end])
        z.shard = new
    else:
        z.shard.zero_()
        z.shard[:piece.numel].copy_(p.data.reshape(-1)[piece.start:piece.end])
    z.written()
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
        # as found: persistent ones too (empty_partition_cache may have freed them)
        release([p for p, was in zip(self.params, self._was_present) if not was], persistent=True)
        return False


def single_rank_group_contradiction(dp_world_size: int, explicit_process_group=None, env=None) -> Optional[str]:
    """Why zero.Init must stop, or None: the launcher started WORLD_SIZE > 1 processes but the
    group parameters would be cut over has one rank (a one-process group set up before
    zero.Init, e.g. by a library loading the model first), so every rank would hold the whole
    model. A group the script passed itself is taken as meant; an unreadable WORLD_SIZE is
    no evidence either way."""
    if dp_world_size != 1 or explicit_process_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launched = int(env.get("WORLD_SIZE") or 0)
    except (TypeError, ValueError):
        return None
    if launched <= 1:
        return None
    return (f"zero.Init: the launcher reports WORLD_SIZE={launched} but the process group has 1 rank, so no parameter "
            "would be partitioned (each rank would hold the whole model); call deepspeed.init_distributed() before "
            "anything sets up a one-process group, or pass data_parallel_group= if one rank is intended")


class Init:
    """`with Init():` modules constructed inside have their parameters partitioned as
    soon as each module's own __init__ returns, so the whole model never exists on one
    rank. As in DeepSpeed, each parameter takes the first rank's values before it is cut
    (ranks seeded differently still build one model), and `module.apply(fn)` inside the
    context runs fn on each module with its cut parameters whole, the first rank's result
    kept (a parent's _init_weights over children built, and cut, before it: Hugging Face's
    post_init); other code that rewrites a cut parameter uses GatheredParameters(...,
    modifier_rank=0).

    Every parameter is cut, as DeepSpeed 0.19.8's Init cuts them (it never applies the config's
    stage3_param_persistence_threshold there): the engine makes the small ones whole again when
    it takes the model, as DeepSpeed's marks them persistent. dslaunch's keyword-only
    `param_persistence_threshold` keeps parameters of at most that many elements whole from the
    start. They are cut over `data_parallel_group`, else `mpu.get_data_parallel_group()`, else
    the world: the engine refuses a model cut over another group than its data-parallel one."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True, remote_device=None,
                 pin_memory: bool = False, config_dict_or_path=None, config=None, enabled: bool = True, dtype=None,
                 mpu=None, zero_param_parallel_group=None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False, sequence_data_parallel_group=None,
                 param_swapper=None, tensor_overrides=None, *, param_persistence_threshold: Optional[int] = None):
        # DeepSpeed's parameters in DeepSpeed's order. mem_efficient_linear picks DeepSpeed's
        # own linear autograd function, which saves memory its hooks would otherwise keep;
        # here F.linear's default saving already keeps only the input. remote_device/pin_memory
        # place the shards: on a machine without CUDA they are on the CPU already.
        if zero_param_parallel_group is not None:
            raise ConfigError("zero.Init(zero_param_parallel_group=...): not supported; set "
                              "zero_optimization.zero_hpz_partition_size in the config: the engine builds hpZ's "
                              "groups from the hosts the launcher reports")
        if param_swapper is not None:
            raise ConfigError("zero.Init(param_swapper=...): not supported (custom swappers are not part of "
                              "dslaunch's ZeRO-3; offload_param.device \"nvme\" has its own)")
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
        self._explicit_group = data_parallel_group  # the script chose it: a 1-rank group is then intended
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = data_parallel_group
        # -1: no parameter (not even an empty one) is kept whole unless the keyword asks
        self.threshold = -1 if param_persistence_threshold is None else param_persistence_threshold
        config_dict = _config_dict(config_dict_or_path or config)
        zero_section = _zero_section(config_dict)
        # ZeRO++ (zeropp.py), from the arguments or the config as DeepSpeed reads them: qwZ for
        # these parameters' training gathers, and frozen ones kept as int8 blocks
        self.quantize_weights = bool(zero_quantized_weights or zero_section.get("zero_quantized_weights", False))
        self.quantize_frozen = bool(zero_quantized_nontrainable_weights
                                    or zero_section.get("zero_quantized_nontrainable_weights", False))
        self.dtype = dtype
        # as DeepSpeed's Init, which makes every floating tensor created inside it this dtype:
        # the buffers of each module built in the context, less those the model names for
        # fp32 (core/module_cast.py); the engine leaves buffers as they are
        self.buffer_dtype = _buffer_dtype(dtype, config_dict)
        data_types = config_dict.get("data_types")
        self.keep_in_fp32 = (data_types.get("keep_in_fp32_modules", "auto") if isinstance(data_types, dict)
                             else "auto")
        self._patched = []
        self._create_in = None  # the CreateInDtype mode while the context is open
        if module is not None and enabled:
            # DeepSpeed's form for a model built outside the context: partition it now (its
            # buffers keep their dtype, except those named for fp32)
            self._require_process_group()
            for sub in module.modules():
                self._partition_own(sub)
            self._keep_named_buffers_fp32(module)

    def _require_process_group(self) -> None:
        # as DeepSpeed's Init: the process group is set up here when the script has not done
        # it (from the launcher's environment, or MPI discovery, as init_distributed does)
        if not (dist.is_available() and dist.is_initialized()):
            comm.init_distributed()
        problem = single_rank_group_contradiction(comm.get_world_size(self.group), self._explicit_group)
        if problem is not None:
            raise RuntimeError(problem)

    def _keep_named_buffers_fp32(self, module) -> None:
        cast_module(module, None, None, keep=keep_in_fp32_pattern(module, self.keep_in_fp32, self.buffer_dtype))

    def _cast_own_buffers(self, module) -> None:
        """A module just built in the context: its own floating buffers to buffer_dtype, then
        the buffers it names for fp32 (its subtree's, as the names are relative to it) back."""
        if self.buffer_dtype is None:
            return
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.dtype in CASTABLE and buf.dtype != self.buffer_dtype:
                buf.data = buf.data.to(self.buffer_dtype)
        self._keep_named_buffers_fp32(module)

    def _partition_own(self, module) -> None:
        for name, p in module.named_parameters(recurse=False):
            # a meta parameter has no values to cut: torch.nn.utils.skip_init (or a model built on
            # the meta device) materialises it with to_empty, which makes a new Parameter; that
            # one is partitioned there (the to_empty wrapper below)
            if not is_partitioned(p) and not p.is_meta:
                if self.dtype is not None and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
                comm.broadcast(p.data, group_src=0, group=self.group, label=f"zero.Init {name}")
                z = partition_param(p, name=name, persistent=p.numel() <= self.threshold, group=self.group)
                z.quantize = self.quantize_weights
                if self.quantize_frozen and not p.requires_grad and not z.persistent:
                    pack_shard(z)

    def __enter__(self):
        if not self.enabled:
            return self
        self._require_process_group()
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                orig = cls.__dict__["__init__"]
                cls.__init__ = self._wrap(orig)
                self._patched.append((cls, "__init__", orig))
        to_empty = torch.nn.Module.__dict__["to_empty"]
        torch.nn.Module.to_empty = self._wrap_to_empty(to_empty)
        self._patched.append((torch.nn.Module, "to_empty", to_empty))
        apply = torch.nn.Module.__dict__["apply"]
        torch.nn.Module.apply = _apply_gathering(apply)
        self._patched.append((torch.nn.Module, "apply", apply))
        if self.buffer_dtype is not None:
            # DeepSpeed's target dtype for every floating tensor made in the context, so weights
            # are sampled in it (init_dtype.py says why that changes their values)
            self._create_in = CreateInDtype(self.buffer_dtype)
            self._create_in.__enter__()
        return self

    def _wrap_to_empty(self, orig):
        init = self

        def to_empty(module, *args, **kwargs):
            out = orig(module, *args, **kwargs)
            with paused():
                for sub in module.modules():
                    init._partition_own(sub)
            return out
        to_empty.__wrapped__ = orig
        return to_empty

    def _wrap(self, orig):
        init = self

        def __init__(module, *args, **kwargs):
            # a subclass's __init__ runs its bases' (wrapped too) and may still write what they
            # made (`super().__init__(); self.weight.data.mul_(0.5)`): only the outermost one
            # cuts, once the whole chain has run, as DeepSpeed's Init does
            depth = module.__dict__.get(_INIT_DEPTH, 0)
            object.__setattr__(module, _INIT_DEPTH, depth + 1)
            try:
                orig(module, *args, **kwargs)
            finally:
                if depth:
                    object.__setattr__(module, _INIT_DEPTH, depth)
                else:
                    object.__delattr__(module, _INIT_DEPTH)
            if not depth:
                with paused():
                    init._cast_own_buffers(module)
                    init._partition_own(module)
        __init__.__wrapped__ = orig
        return __init__

    def __exit__(self, *exc):
        if self._create_in is not None:
            self._create_in.__exit__(*exc)
            self._create_in = None
        for cls, attr, orig in reversed(self._patched):
            setattr(cls, attr, orig)
        self._patched.clear()
        return False


_INIT_DEPTH = "_zero_init_depth"  # how many wrapped __init__ of a module's class chain are running


def _apply_gathering(orig):
    """Module.apply whose fn sees each module's cut parameters whole (DeepSpeed's Init does so)."""

    def apply(module, fn):
        return orig(module, _gathering(fn))
    apply.__wrapped__ = orig
    return apply


def _gathering(fn):
    """fn(module) with the module's own cut parameters gathered, and the first rank's values
    made every rank's shards afterwards. Module.apply recurses through the patched apply, and
    nested Init contexts wrap twice: a function wrapped once is not wrapped again."""
    if getattr(fn, "_zero_gathering", False):
        return fn

    @functools.wraps(fn)
    def gathering(module):
        params = [p for p in module.parameters(recurse=False) if is_partitioned(p)]
        if not params:
            return fn(module)
        # the gather and the write-back keep their buffers' dtypes; fn is the script's code
        gathered = GatheredParameters(params, modifier_rank=0)
        with paused():
            gathered.__enter__()
        try:
            out = fn(module)
        except BaseException:
            with paused():
                gathered.__exit__(*sys.exc_info())
            raise
        with paused():
            gathered.__exit__(None, None, None)
        return out
    gathering._zero_gathering = True
    return gathering


def _all_module_classes():
    seen, stack = [], [torch.nn.Module]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.append(c)
        stack.extend(c.__subclasses__())
    return seen


def _config_dict(config) -> dict:
    """The config as a dict ({} without one); a path is read."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        from ..core.strict import load_file  # bounded, regular files only, one-line errors

        config = load_file(os.fspath(config))
    return config if isinstance(config, dict) else {}


def _zero_section(config: dict) -> dict:
    """The config's zero_optimization section ({} without one)."""
    zero = config.get("zero_optimization", {})
    return zero if isinstance(zero, dict) else {}


def _enabled(config: dict, *names: str) -> bool:
    return any(isinstance(config.get(n), dict) and config[n].get("enabled") is True for n in names)


def _buffer_dtype(dtype, config: dict):
    """The dtype DeepSpeed's Init gives the floating buffers a module makes in its __init__:
    Init's dtype, else the config's fp16/bf16 (None: they keep theirs)."""
    if dtype is not None:
        return dtype
    if _enabled(config, "bf16", "bfloat16"):
        return torch.bfloat16
    if _enabled(config, "fp16"):
        return torch.float16
    return None
