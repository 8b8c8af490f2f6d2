"""ZeRO stage 3 (`ZeroStage3`, the engine strategy): parameters, gradients and optimizer
state all partitioned over the data-parallel group.

Around every module that owns parameters directly:
  pre-forward   gather its parameters (plus, once the forward order is known, the
                parameters of the next modules up to stage3_prefetch_bucket_size
                elements, in the same collective)
  post-forward  release them; wrap the outputs so that when their gradient arrives
                the parameters are gathered again (pre-backward)
  post-accumulate-grad (per parameter)  queue the full gradient, release the parameter;
                a queue of reduce_bucket_size elements is reduce-scattered in one
                collective into each rank's gradient chunks (the policy's grad dtype). Autograd
                runs a leaf's AccumulateGrad once per backward after every use of the
                leaf has contributed, so tied and reused parameters are safe to drop.

Every micro-step gathers parameters and reduce-scatters gradients (as in DeepSpeed); the
boundary adds only the norm and the refresh of persistent parameters. The gradient
chunks are freed at the step and allocated again by the next reduce-scatter: between steps
no gradient is held (as in DeepSpeed), leaving the room to the next forward's activations.

Parameters at most stage3_param_persistence_threshold elements stay whole until
engine.empty_partition_cache frees them, as DeepSpeed's do. Frozen parameters (and any the
optimizer does not hold) are partitioned by the same size rule, gathered around their modules
like the rest, and released when their module's backward is done (an autograd function on the
module's inputs, as DeepSpeed's post-backward hook), or at the end of the backward when no
input of the module needs a gradient; under zero_quantized_nontrainable_weights their shards
are kept as int8 blocks. Optimizer partitions are the concatenation of this rank's chunks per
param group. With offload_param.device "nvme" the other shards rest in
files between uses (param_swap.py). ZeRO++ (qwZ, qgZ, hpZ) changes what the gathers and the
gradient reduction send, not what is computed: zeropp.py.
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from typing import Any, Dict, List, Optional

import torch

# DeepSpeed's ZeRO-3 optimizer class, for isinstance (core/internals.py); deepspeed.runtime.zero.stage3 names it
from ..core.internals import DeepSpeedZeroOptimizer_Stage3  # noqa: F401
from ..core.muon.sharded import ShardedMuon, resident_keys, chunked_updates
from ..core.reduction import GradReduction
from ..core.shard_state import FrozenRecord, ShardKind, ShardLayout
from ..core.strict import ConfigError
from ..core.strategy import StrategyContext, check_numel, register_strategy, state_tensor
from ..core import comm
from . import hook_scope
from .hook_scope import (hooked_modules, module_params, set_leaves_by_granularity, tracked_modules,
                         unmarked_expert_lists, z3_leaf_module)
from .offload import OptimizerHost, make_host, pin_host
from .offload_states import StateMover
from ..core.config.zero import OffloadStateTypeEnum
from .param_reads import ReadWatches
from .params import gather, is_partitioned, is_present, keep_whole, pack_shard, partition_param, release, rest
from .partition import Piece, param_shard, pieces_to_dict
from .prefetch import ModuleTrace, Prefetcher
from .sharded import ShardedStrategy, offload_optimizer
from .reshard import assemble
from .zeropp import ZeroPP, ZeroPPSettings, qgz_blocks


class RankDivergenceError(RuntimeError):
    pass


class DivergenceCheck:
    """Opt-in (zero_optimization.enable_sanity_checks, DSLAUNCH_ZERO3_CHECK=1, or check=True):
    before each stage-3 collective every rank shares a fixed-size description of what it
    is about to do, so a rank that calls modules in another order or number fails with
    both ranks' module names instead of hanging in mismatched collectives."""

    WIDTH = 160

    def __init__(self, group=None):
        self.group = group
        self.count = 0

    def __call__(self, what: str) -> None:
        n = comm.get_world_size(self.group)
        if n == 1:
            return
        self.count += 1
        data = f"#{self.count} {what}".encode()[:self.WIDTH]
        mine = torch.zeros(self.WIDTH, dtype=torch.uint8)
        mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        out = torch.empty(n * self.WIDTH, dtype=torch.uint8)
        comm.all_gather_into_tensor(out, mine, group=self.group, label=f"stage3 divergence check #{self.count}")
        seen = [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in out.view(n, -1)]
        if len(set(seen)) > 1:
            lines = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise RankDivergenceError(f"ZeRO-3 ranks diverged (modules called in a different order or number): {lines}")


class _PostBackward(torch.autograd.Function):
    """Applied to a module's inputs: its backward runs once the gradients of all of them are
    computed, i.e. once the module's own backward is done (DeepSpeed's PostBackwardFunctionModule).
    Detached outputs, not views: the module may modify its inputs in place."""
    @staticmethod
    def forward(engine, module, *xs):
        return tuple(x.detach() for x in xs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.engine, ctx.module = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.module_backward_done(ctx.module)
        return (None, None) + grads


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, module, *xs):
        ctx.engine, ctx.module = engine, module
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.gather_module(ctx.module, "backward")
        return (None, None) + grads


@register_strategy(3)
class ZeroStage3(ShardedStrategy):
    """Parameters partitioned at rest, gathered around each module's forward/backward."""

    communicates_every_micro_step = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        ctx.refuse_foreign_axes("ZeRO stage 3")  # one group for every parameter (DeepSpeed refuses MoE here too)
        # small modules as leaves (stage3_module_granularity_threshold), before the hooks are placed
        set_leaves_by_granularity(ctx.module, ctx.config.zero_optimization.stage3_module_granularity_threshold)
        unmarked = unmarked_expert_lists(ctx.module)
        if unmarked:  # without the leaf, ranks that route differently gather different experts: a hang
            name, cls = unmarked[0]
            raise ConfigError(f"ZeRO stage 3: {name} ({cls}) routes tokens to the experts of its `experts` list, "
                              "so ranks may gather different experts (a hang); call "
                              f"deepspeed.utils.set_z3_leaf_modules(model, [{cls}]) before deepspeed.initialize")
        z = ctx.config.zero_optimization
        module, optimizer, group = self.module, self.optimizer, self.group
        persistence_threshold = z.stage3_param_persistence_threshold
        offload, sub_group_size = offload_optimizer(ctx), z.sub_group_size
        offload_param = z.offload_param if z.offload_param is not None and z.offload_param.device != "none" else None
        self.prefetch_numel = int(z.stage3_prefetch_bucket_size)
        # DeepSpeed's stage3_max_live_parameters (prefetching stops there) and
        # stage3_max_reuse_distance (a module reused within that many elements stays gathered)
        self.max_live = int(z.stage3_max_live_parameters)
        self.max_reuse = int(z.stage3_max_reuse_distance)
        self.reduce_numel = int(z.reduce_bucket_size)
        self._bucket: List = []
        self._bucket_numel = 0
        # inside engine.coalesce_grad_reduction(): each parameter's padded full gradient, summed
        # over the block's backwards and reduce-scattered once when it ends (None: not holding)
        self._held: Optional[Dict[int, tuple]] = None
        # ids of parameters whose gradient landed since a script's optimizer.zero_grad() (None: none
        # pending; restart_accumulation)
        self._restarted: Optional[set] = None
        self.check = DivergenceCheck(group) if z.sanity_checks() else None
        self.param_device = torch.device("cpu") if getattr(offload_param, "device", "none") in ("cpu", "nvme") else None
        names = {}
        for n, p in module.named_parameters():
            names.setdefault(id(p), n)
        pp = ZeroPPSettings.from_config(z)
        self.zeropp: Optional[ZeroPP] = None
        if pp.any:  # collective: the hosts of the data-parallel ranks, hpZ's and qgZ's groups
            make = ctx.mesh.new_group if ctx.mesh is not None and hasattr(ctx.mesh, "new_group") else None
            if make is None:
                from ..core.parallel.mesh import new_group as make
            self.zeropp = ZeroPP(pp, group, self.world, self.rank, make)
        # A module already driven by another stage-3 engine (the HF Trainer's forward-only engine
        # for evaluate(), then train()'s own): this engine takes it over, the other's hooks go.
        for old in {id(z.owner): z.owner for z in (getattr(p, "_zero", None) for p in module.parameters())
                    if z is not None and z.owner is not None}.values():
            old.remove_hooks()
        # zero.Init cuts every parameter, as DeepSpeed's does; the small ones become whole here, as
        # DeepSpeed's engine marks them persistent (mark_persistent_parameters)
        kept_whole: List[torch.nn.Parameter] = []
        for n, p in module.named_parameters():
            becomes_whole = False
            if not is_partitioned(p):
                # by size alone, frozen or not, as DeepSpeed's stage 3 partitions them
                partition_param(p, name=n, persistent=p.numel() <= persistence_threshold,
                                device=self.param_device, group=group)
            elif (p._zero.world, p._zero.rank) != (self.world, self.rank):
                raise ValueError(f"ZeRO-3: {n} was partitioned (zero.Init) over {p._zero.world} ranks, but the "
                                 f"data-parallel group has {self.world}; pass zero.Init(data_parallel_group=...) "
                                 "or mpu= so both use the same group")
            elif not p._zero.persistent and p._zero.numel <= persistence_threshold:
                becomes_whole = True
                kept_whole.append(p)
            p._zero.group = group
            p._zero.name = n
            p._zero.owner = self
            if p._zero.packed is not None:  # int8 blocks: only the dtype they come back as changes
                p._zero.packed.dtype = p.dtype
            elif p._zero.shard.dtype != p.dtype:  # built by zero.Init, then cast by the engine
                p._zero.shard = p._zero.shard.to(p.dtype)
            if self.zeropp is not None:
                p._zero.zeropp = self.zeropp
                p._zero.quantize = p._zero.quantize or pp.quantize_weights
                p._zero.secondary = None
                if pp.quantize_frozen and not p.requires_grad and not p._zero.persistent and not becomes_whole:
                    pack_shard(p._zero)
            if offload_param is not None and offload_param.device == "cpu" and p._zero.packed is None:
                p._zero.shard = pin_host(p._zero.shard, bool(getattr(offload_param, "pin_memory", False)))
        keep_whole(kept_whole)
        self.groups: List[Dict[str, Any]] = []
        # summed in fp16: divided before the sum, as DeepSpeed's stage 3 does (core/precision.py)
        self.reduction = GradReduction.from_config(ctx.config, self.world, ctx.precision.sums_in_fp16)
        # the masters', gradient partitions' and optimizer state's dtypes: the precision policy's
        self.precision = ctx.precision
        master_dtype, accum = ctx.precision.master, ctx.precision.grad
        ctx.precision.check_optimizer(optimizer, offload is not None, 3)
        # optimizer None: forward only (ZeRO inference), no masters, gradients or optimizer host;
        # no backward can follow a forward (engine.backward needs an optimizer, as DeepSpeed's)
        self._forward_only = optimizer is None
        param_groups = optimizer.param_groups if optimizer is not None else []
        self.listed_names = [[names.get(id(p), "") for p in pg["params"]] for pg in param_groups]
        seen = set()
        self._shard_is_master: set = set()  # ids of params whose shard is a view of their group's master
        for gi, pg in enumerate(param_groups):
            params = [p for p in pg["params"] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            off, pieces = 0, []
            for p in params:
                z = p._zero
                z.master_offset, z.group_index = off, gi
                sh = param_shard(z.numel, self.world, self.rank)
                if sh.numel:
                    pieces.append(Piece(z.name, sh.start, sh.end, off))
                off += z.chunk
            host = getattr(offload, "device", "none") in ("cpu", "nvme")
            to_files = getattr(offload_param, "device", "none") == "nvme"  # shards then rest in files, apart
            pin = host and bool(getattr(offload, "pin_memory", False))
            master = pin_host(torch.zeros(max(off, 1), dtype=master_dtype,
                                          device=torch.device("cpu") if host else _device(params)), pin)
            for p in params:
                z = p._zero
                view = master[z.master_offset:z.master_offset + z.chunk]
                view.copy_(z.shard)
                if not to_files and z.shard.dtype == master_dtype and z.shard.device == master.device:
                    # parameters in the masters' dtype (fp32, or bf16 with bf16 masters): the shard is the
                    # master, one copy updated in place by the step (DeepSpeed keeps a second, equal one)
                    z.shard = view
                    self._shard_is_master.add(id(p))
            # "grad": the reduced gradient chunks, allocated by the window's first reduce-scatter (_grad)
            self.groups.append({"params": params, "master": master, "grad": None, "grad_dtype": accum, "pin": pin,
                                "pieces": pieces, "shapes": {p._zero.name: list(p._zero.shape) for p in params}})
            pg["params"] = [master]
        if optimizer is not None:
            optimizer.state.clear()
            # DeepSpeed's stage-3 names for each sub-group's parameters and its flat fp32 partition
            # (the key of optimizer.state), which its tests and tools read. A param group is one
            # sub-group here: sub_group_size chunks the offloaded step instead (offload.py), while
            # engine._get_zero_param_shapes() gives DeepSpeed's sub-group split, for checkpoints
            optimizer.fp16_groups = [g["params"] for g in self.groups]
            optimizer.fp32_partitioned_groups_flat = [g["master"] for g in self.groups]
            optimizer._get_norm_groups = _norm_groups_of(self)
        self.optimizer_on_host = offload is not None  # offload_states leaves masters, state and gradients there
        self.mover = StateMover()  # what engine.offload_states moved (offload_states.py)
        self.swapper = None
        if getattr(offload_param, "device", "none") == "nvme":  # shards rest in files between uses
            from .param_swap import ParamSwapper

            self.swapper = ParamSwapper(offload_param.nvme_path, self.rank)
            # shards kept as int8 blocks (frozen weights) stay in memory
            self.swapper.attach(p._zero for p in module.parameters()
                                if not p._zero.persistent and p._zero.packed is None)
        self.host: Optional[OptimizerHost] = None if optimizer is None else \
            make_host(optimizer, [g["master"] for g in self.groups], offload, sub_group_size, resident_keys(ctx.config))
        # Muon: whole-matrix updates from the chunks, before the norm as in DeepSpeed (muon/sharded.py)
        self.muon = ShardedMuon(optimizer, self.host, ctx.loss_scale) if ShardedMuon.applies(optimizer) else None
        self._hooks = []
        self._trace: List[torch.nn.Module] = []
        self._recording = True
        self._pos = 0
        self._trace_ok = False
        self._names = {id(m): (n or type(m).__name__) for n, m in module.named_modules()}
        # what each hooked module's hooks gather, computed once: the hooks run for every module
        # on every forward and backward, and walking named_parameters there dominated small steps
        self._own_cache: Dict[int, List[torch.nn.Parameter]] = {}
        self._own_version = -1
        self._index: Optional[ModuleTrace] = None
        # trace entry of each module whose forward is running (-1: none; None: one that gathers nothing)
        self._stack: List[Optional[int]] = []
        self._running: List[torch.nn.Module] = []  # those modules and the root, innermost last
        self._hooked: set = set()  # id of each module whose forward hooks gather its parameters
        self._tracked: set = set()  # id of each module with the forward hooks (a superset)
        self._rerecord = False  # the recorded module order no longer says where parameters are used
        self._watches: Optional[ReadWatches] = None  # parameters read by name (_read)
        self._prefetch = Prefetcher(self._own, self._name, self.check)
        self._total_numel = sum(p._zero.numel for p in module.parameters() if not p._zero.persistent)
        # leaf modules' gradients are queued together once the leaf's backward is done (below)
        self._leaf_params: Dict[int, List[torch.nn.Parameter]] = {}
        self._leaf_of: Dict[int, torch.nn.Module] = {}
        self._leaf_pending: Dict[int, torch.nn.Module] = {}  # leaves gathered for backward, not yet queued
        # qgZ: the int4 block count of each gradient that takes it (by shape, as DeepSpeed decides)
        self._qgz_blocks: Dict[int, int] = {}
        if self.zeropp is not None and self.zeropp.qgz is not None:
            trained = [p for g in self.groups for p in g["params"]]
            for p in trained:
                b = qgz_blocks(p._zero.shape, self.world)
                if b is not None:
                    self._qgz_blocks[id(p)] = b
            plain = [p._zero.name for p in trained if id(p) not in self._qgz_blocks]
            if plain and self.rank == 0:
                print(f"dslaunch: ZeRO++ qgZ: {len(plain)} of {len(trained)} gradients take the plain reduce-scatter "
                      f"(1-D, or a size qgZ's blocks cannot split over {self.world} ranks, as in DeepSpeed): "
                      f"{', '.join(plain[:4])}{', ...' if len(plain) > 4 else ''}", file=sys.stderr, flush=True)

    # -- hooks ------------------------------------------------------------------------------
    def wrap_module(self) -> None:
        self._hooks.append(self.module.register_forward_pre_hook(self._root_pre))
        self._hooks.append(self.module.register_forward_hook(self._root_post))
        # and if the forward raises: no module runs any more, so no read by name gathers (_read)
        self._hooks.append(self.module.register_forward_hook(lambda *_: self._running.clear(), always_call=True))
        trained = {id(p) for g in self.groups for p in g["params"]}
        # frozen parameters (and any the optimizer does not hold): no post-accumulate-grad hook
        # releases them after their module's backward; module_backward_done and after_backward do
        self._untrained = [p for p in self.module.parameters() if id(p) not in trained]
        self._untrained_ids = {id(p) for p in self._untrained}
        self._hooked, self._tracked = set(), set()
        for m in self.module.modules():
            hook_scope.init_external_params(m)
        for m in hooked_modules(self.module):  # leaf modules (set_z3_leaf_modules) as one unit
            self._hook_module(m)
        # the modules with nothing to gather are hooked too, only to be on the stack of running
        # modules: a parameter handed up through one (`return out, self.bias`) or read by name in
        # its forward is registered with it, as DeepSpeed (which hooks every module) does
        for m in tracked_modules(self.module):
            if id(m) not in self._tracked and m is not self.module:
                self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
                self._hooks.append(m.register_forward_hook(self._post_forward))
                self._tracked.add(id(m))
            if z3_leaf_module(m):
                params = [p for p in self._own(m) if id(p) in trained]
                if params:
                    self._leaf_params[id(m)] = params
                    self._leaf_of.update((id(p), m) for p in params)
                    self._hooks.append(m.register_full_backward_hook(self._leaf_backward_done))
        for g in self.groups:
            for p in g["params"]:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._watches = ReadWatches(self.module, self._read)

    def _hook_module(self, m) -> None:
        self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
        self._hooks.append(m.register_forward_hook(self._post_forward))
        self._hooked.add(id(m))
        self._tracked.add(id(m))

    def _root_pre(self, module, args):
        comm.comms_logger.set_phase("forward")  # the comms logger's traffic rows (comm/traffic.py)
        self._prefetch.start_forward()  # a forward-only pass may have left prefetches behind
        self._pos = 0
        self._stack.clear()
        self._running[:] = [module]  # the root's own code may read parameters too (_read)
        if self._watches is not None:
            self._watches.cover(module)  # a module attached since initialize is watched too

    def _root_post(self, module, args, out):
        # `_running` is cleared by the always_call hook registered after this one (wrap_module)
        if self._recording and self._trace:
            self._recording = False
            self._index = ModuleTrace(self._trace, self._own, self._numel_of)
            self._trace_ok = True
        if self._rerecord:  # a parameter became external during this forward: the next one records anew
            self._rerecord = False
            self._prefetch.drop_all()
            self._trace, self._recording, self._trace_ok, self._index = [], True, False, None
        if torch.is_grad_enabled():
            comm.comms_logger.set_phase("backward")
            self._prefetch.start_backward(len(self._trace))
            if self.swapper is not None and self._trace_ok:  # the first modules of backward
                self._swap_ahead(range(len(self._trace) - 1, -1, -1))
        else:
            self._prefetch.drop_all()

    def _own(self, m) -> List[torch.nn.Parameter]:
        """The parameters m's hooks gather (do not modify the list)."""
        if self._own_version != hook_scope.registrations:
            self._own_cache.clear()
            self._own_version = hook_scope.registrations
        own = self._own_cache.get(id(m))
        if own is None:
            own = self._own_cache[id(m)] = module_params(m)
        return own

    def _name(self, m) -> str:
        return self._names.get(id(m), type(m).__name__)

    def gather_module(self, m, phase: str, at: int = -1) -> None:
        """Make m's parameters whole (landing the prefetches that carry them), then start the
        gathers of the modules expected next. `at`: m's entry in the recorded forward."""
        params = self._own(m)
        self._prefetch.land(params)
        gather(params, check=self.check, what=f"{self._name(m)} ({phase})", training=True)
        self._hold(m, params)
        if phase == "backward" and id(m) in self._leaf_params:
            self._leaf_pending[id(m)] = m
        if not (self._trace_ok and self.prefetch_numel > 0):
            return
        room = self.prefetch_numel
        if self._total_numel > self.max_live:  # only then can the live limit bind
            room = min(room, self.max_live - self._live_numel() - self._prefetch.inflight_numel())
        if phase == "forward" and at >= 0:
            self._prefetch.run(self._index, room, forward=True, start=at)
        elif phase == "backward":
            self._prefetch.done_backward.add(id(m))
            self._prefetch.run(self._index, room, forward=False, start=len(self._trace))
            if self.swapper is not None:  # file reads for the module expected next in backward
                self._swap_ahead(range(self._prefetch.behind, -1, -1), skip=self._prefetch.done_backward)

    def _swap_ahead(self, positions, skip=()) -> None:
        """Start reading from their files the shards of the trace entries in `positions` (not in
        `skip`) that are still there: the first such entry, and more while they fit in the
        prefetch bucket, the window the next prefetch gathers will take."""
        budget = self.prefetch_numel
        for i in positions:
            nxt = self._trace[i]
            if id(nxt) in skip:
                continue
            waiting = [p._zero for p in self._own(nxt) if is_partitioned(p) and not is_present(p)
                       and p._zero.resident is None]
            if not waiting:
                continue
            self.swapper.prefetch(waiting)
            budget -= sum(z.numel for z in waiting)
            if budget <= 0:
                return

    def _pre_forward(self, m, args):
        if id(m) not in self._hooked:
            if self._own(m):  # a parameter registered with it since (register_external_parameter)
                self._hooked.add(id(m))
            else:  # nothing to gather: only where the forward is (wrap_module)
                self._stack.append(None)
                self._running.append(m)
                return None
        at = -1
        if self._recording:
            self._trace.append(m)
        elif self._trace_ok and self._pos < len(self._trace) and self._trace[self._pos] is m:
            at, self._pos = self._pos, self._pos + 1
        else:
            self._trace_ok = False  # this forward differs from the recorded one: no more prefetching
        self._stack.append(at)
        self._running.append(m)
        self.gather_module(m, "forward", at)
        if self.swapper is not None and self._trace_ok:  # read while this module computes, beyond
            # the modules whose gathers are already started (those read their shards when issued)
            self._swap_ahead(range(max(self._pos, self._prefetch.ahead), len(self._trace)))
        if torch.is_grad_enabled() and not self._forward_only and self._untrained_of(m):
            return _wrap_inputs(self, m, args)
        return None

    def _untrained_of(self, m) -> List[torch.nn.Parameter]:
        """m's partitioned parameters that no gradient hook releases (frozen ones)."""
        return [p for p in self._own(m) if id(p) in self._untrained_ids and is_partitioned(p)
                and not p._zero.persistent]

    def module_backward_done(self, m) -> None:
        """m's backward is done: its frozen parameters that no other module's backward holds are
        released, as DeepSpeed's release_sub_module does after a module's backward. (The trained
        ones are released by their gradient hooks, once every use has contributed.)"""
        done = []  # m.ds_id was set by m's pre-forward gather (_hold), before _PostBackward was applied
        for p in self._untrained_of(m):
            p.ds_active_sub_modules.discard(m.ds_id)
            if not p.ds_active_sub_modules:
                done.append(p)
        release(done)

    def _post_forward(self, m, args, out):
        at = self._stack.pop() if self._stack else -1
        if self._running:
            self._running.pop()
        if at is None:
            if id(m) not in self._hooked:
                self._handed_out(m, out)  # registered with the module around m, as any module's
                return None
            at = -1  # made external to m during this forward (_make_external): released below
        params = self._own(m)
        handed = self._handed_out(m, out)
        if handed:
            params = [p for p in params if all(p is not q for q in handed)]
        if not (self._trace_ok and at >= 0):
            release(params)
        elif not self._reused_soon(at):
            release([p for p in params if not self._index.used_after(p, at)])
        if torch.is_grad_enabled():
            return _wrap_outputs(self, m, out)
        return out

    def _handed_out(self, m, out) -> List[torch.nn.Parameter]:
        """The partitioned parameters m's forward returns (`return out, self.bias`), which the
        module running around m uses after m's forward ends: m's post-forward leaves them whole.
        The first time, each is registered as external to that module, whose hooks then gather
        and release it with their own, and marked `is_external_param`, as DeepSpeed 0.19.8 does
        with its "dangling" parameters (it looks at the same places: the output itself, the
        items of a list or tuple, the values of a dict or of an output object's attributes)."""
        if torch.compiler.is_compiling():
            return []
        if not self._running and torch._C._current_graph_task_id() == -1:
            return []  # a module called on its own, outside any forward of the model: nothing uses them
        handed = []
        for x in _output_items(out):
            p = _param_behind(x)
            if p is not None and all(p is not q for q in handed):
                handed.append(p)
        if not self._running:
            # activation checkpointing's recompute, inside the backward: the function around m uses
            # them next, as in the forward; they were registered then, and are released as usual
            # (gradient hook, end of the module's backward, end of the backward)
            return handed
        for p in handed:
            if any(hook_scope.is_external_to(mm, p) for mm in self._running):
                continue  # a module running around m already gathers it
            p.is_external_param = True
            self._make_external(self._running[-1], p)
            if hook_scope.is_external_to(m, p):
                hook_scope.unregister_external_parameter(m, p)  # the outer module covers it now
        return handed

    def _make_external(self, m, p) -> None:
        """Register p as external to m, a module whose forward is running, for a read by name
        (_read) or a parameter handed out by a child (_handed_out)."""
        hook_scope.register_external_parameter(m, p)
        if id(m) in self._tracked:
            # its hooks gather from now on; its post-forward hook (at the end of this forward)
            # releases p, and its outputs' backward gathers it again
            self._hooked.add(id(m))
        elif id(m) not in self._hooked:
            # the root, the same from now on
            self._hook_module(m)
        self._trace_ok = False  # no prefetching for the rest of this forward, and the next one records
        self._rerecord = True

    def _read(self, p) -> None:
        """A parameter read by name while a forward runs (param_reads.py). One that is not whole
        (its module's forward has released it, or never ran) is gathered now and registered as
        external to the innermost module whose forward is running, whose hooks gather it from
        then on and release it with their own, as DeepSpeed's ZeROOrderedDict does."""
        if not self._running or not is_partitioned(p) or is_present(p) or torch.compiler.is_compiling():
            return
        m = self._running[-1]
        self._make_external(m, p)
        self._prefetch.land([p])
        gather([p], check=self.check, what=f"{p._zero.name} read in {self._name(m)}", training=True)
        self._hold(m, [p])

    @staticmethod
    def _hold(m, params) -> None:
        # DeepSpeed's ds_active_sub_modules: m's hooks hold these until release() empties the set
        if "ds_id" not in m.__dict__:  # DeepSpeed numbers the modules it hooks the same way
            m.ds_id = next(_module_ids)
        for p in params:
            if is_partitioned(p) and not p._zero.persistent:
                p.ds_active_sub_modules.add(m.ds_id)

    def _numel_of(self, m) -> int:
        return sum(p._zero.numel for p in self._own(m) if is_partitioned(p) and not p._zero.persistent)

    def _live_numel(self) -> int:
        return sum(p._zero.numel for g in self.groups for p in g["params"]
                   if not p._zero.persistent and is_present(p))

    def _reused_soon(self, at: int) -> bool:
        """Whether the parameters of trace entry `at` stay gathered after its forward
        (stage3_max_reuse_distance), unless stage3_max_live_parameters are already live. The
        backward counts only where one can come: in grad mode, with an optimizer."""
        if self._total_numel > self.max_live and self._live_numel() > self.max_live:
            return False
        return self._index.reused_within(at, self.max_reuse, torch.is_grad_enabled() and not self._forward_only)

    def _grad_ready(self, p) -> None:
        """Queue this parameter's full gradient (module dtype, padded) and release the parameter;
        reduce-scatter the queue once it holds reduce_bucket_size elements. A leaf module's
        parameters wait for the end of the leaf's backward (_queue_leaf)."""
        if id(p) not in self._leaf_of:
            self._queue_grad(p)

    def _leaf_backward_done(self, m, grad_input, grad_output) -> None:
        # Called once the gradients of m's inputs are computed, after every AccumulateGrad of
        # its parameters (those run as soon as they are ready). With no input that needs a
        # gradient torch calls it before m's backward instead; after_backward queues m then.
        if any(g is not None for g in grad_input) and id(m) in self._leaf_pending:
            self._queue_leaf(self._leaf_pending.pop(id(m)))

    def _queue_leaf(self, m) -> None:
        """Queue every parameter of leaf m in a fixed order, a zero gradient for those that got
        none: a router sends tokens to different experts on each rank, and the experts that
        got no tokens here get no gradient, while every rank's reduce-scatters must hold the
        same parameters in the same order."""
        for p in self._leaf_params[id(m)]:
            if p.grad is None:
                p.grad = torch.zeros(p._zero.shape, dtype=p.dtype, device=p.device)
            self._queue_grad(p)

    def _queue_grad(self, p) -> None:
        z = p._zero
        if self._held is not None and id(p) in self._held:
            self._held[id(p)][1][:z.numel].add_(p.grad.reshape(-1).to(self._held[id(p)][1].dtype))
            p.grad = None
            release([p])
            return
        full = torch.zeros(z.chunk * self.world, dtype=p.grad.dtype, device=p.grad.device)  # reduced in module dtype
        full[:z.numel].copy_(p.grad.reshape(-1))
        if self._held is not None:
            self._held[id(p)] = (p, full)
            p.grad = None
            release([p])
            return
        self._bucket.append((p, full))
        self._bucket_numel += full.numel()
        p.grad = None
        release([p])
        if self._bucket_numel >= self.reduce_numel:
            self._flush_grads()

    def _flush_grads(self) -> None:
        """One reduce-scatter for the queued gradients: laid out as a (world, sum of
        chunks) matrix so rank r's row holds its chunk of every queued parameter. Under qgZ
        the gradients that qualify go through its two quantized all-to-alls instead
        (zeropp.QuantizedReduceScatter), all of the bucket's at once."""
        if not self._bucket:
            return
        bucket, self._bucket, self._bucket_numel = self._bucket, [], 0
        if self.check is not None:
            self.check("reduce grads of " + ", ".join(p._zero.name for p, _ in bucket))
        quant = [(p, full) for p, full in bucket if id(p) in self._qgz_blocks]
        plain = [(p, full) for p, full in bucket if id(p) not in self._qgz_blocks]
        if plain:
            self._reduce_scatter(plain)
        if quant:
            names = f"{quant[0][0]._zero.name}..{quant[-1][0]._zero.name}"
            parts = self.zeropp.qgz([self.reduction.outgoing(full) for _, full in quant],
                                    [self._qgz_blocks[id(p)] for p, _ in quant], f"stage3 qgZ reduce grads {names}")
            for (p, _), part in zip(quant, parts):
                self._land(p, self._averaged(part))

    def _reduce_scatter(self, bucket) -> None:
        width = sum(p._zero.chunk for p, _ in bucket)
        device = bucket[0][1].device
        mat = torch.cat([full.view(self.world, -1) for _, full in bucket], dim=1) if len(bucket) > 1 \
            else bucket[0][1].view(self.world, -1)
        flat = self.reduction.outgoing(mat.contiguous().view(-1))
        part = torch.empty(width, dtype=flat.dtype, device=device)
        comm.reduce_scatter_tensor(part, flat, group=self.group,
                                   label=f"stage3 reduce grads {bucket[0][0]._zero.name}..{bucket[-1][0]._zero.name}")
        part = self._averaged(part)
        off = 0
        for p, _ in bucket:
            self._land(p, part[off:off + p._zero.chunk])
            off += p._zero.chunk

    def _land(self, p, piece: torch.Tensor) -> None:
        """This rank's averaged share of p's gradient into its partition: added to what
        earlier backwards left, or written over it on p's first landing after a script's
        optimizer.zero_grad() (restart_accumulation)."""
        z = p._zero
        g = self._grad(z.group_index)
        dest = g[z.master_offset:z.master_offset + z.chunk]
        if self._restarted is not None and id(p) not in self._restarted:
            self._restarted.add(id(p))
            dest.copy_(piece)
        else:
            dest += piece.to(g.device)

    def restart_accumulation(self) -> None:
        """A script's optimizer.zero_grad() at stage 3, as DeepSpeed's: the next backward's
        gradients overwrite the partitions instead of adding to them. Until then the partitions
        stand, and a step taken before that backward uses them, as DeepSpeed's does."""
        self._restarted = set()

    def _averaged(self, part: torch.Tensor) -> torch.Tensor:
        """A reduce-scatter's result in the partitions' dtype, divided the rest of the way to the
        mean: each micro-step's share is averaged as it lands, as DeepSpeed's stage 3 does, so the
        partitions hold averaged gradients between any backward and the step (what
        get_fp32_grad_partitions and averaged_gradients show, accumulating until the step frees
        them or a script's optimizer.zero_grad() restarts them)."""
        accum = self.precision.grad
        return self.reduction.finish_(part if part.dtype == accum else part.to(accum))

    def before_backward(self, is_boundary: bool = True) -> None:
        pass

    def after_backward(self, is_boundary: bool = True) -> None:
        self._prefetch.drop_all()  # gathered for a module that took no part in this backward
        for m in [self._leaf_pending.pop(k) for k in list(self._leaf_pending)]:  # in backward order
            self._queue_leaf(m)
        self._flush_grads()
        self._restarted = None  # the backward after a restart is over: later ones add again
        if self.check is not None:
            self.check("end of backward")
        for g in self.groups:
            release(g["params"])
        # frozen parameters of modules none of whose inputs needed a gradient (module_backward_done
        # never ran for them) and of modules that took no part in this backward
        release(self._untrained)

    def hold_reductions(self) -> None:
        self._held = {}

    def release_held_reductions(self, reduce: bool) -> None:
        """The held gradients join the reduce queue in the order they first arrived, which
        is the same on every rank (one backward order); reduce: flushed now, in buckets of
        reduce_bucket_size, otherwise the next backward's flush or the step's takes them."""
        held, self._held = self._held or {}, None
        for p, full in held.values():
            self._bucket.append((p, full))
            self._bucket_numel += full.numel()
            if reduce and self._bucket_numel >= self.reduce_numel:
                self._flush_grads()
        if reduce:
            self._flush_grads()

    # -- boundary -------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        comm.comms_logger.set_phase("step")
        self._flush_grads()  # gradients a coalesce block left queued when it raised (nothing otherwise)
        if self.muon is not None:
            for gi in self.muon.groups():
                g = self.groups[gi]
                if g["params"]:
                    layout = [(p._zero.name, tuple(p._zero.shape), p._zero.numel, p._zero.master_offset,
                               p._zero.chunk) for p in g["params"]]
                    chunked_updates(self.muon, gi, self._grad(gi), g["master"], layout, self.world, self.rank,
                                    self.group, self.ctx.distributed)

    def _group_squares(self, label: str) -> torch.Tensor:
        """Per param group, the sum of squares of the reduced gradient partitions over the
        whole data-parallel group (one all-reduce)."""
        sq = torch.zeros(len(self.groups), dtype=torch.float32)
        skip = self.ctx.norm_exclude
        for i, g in enumerate(self.groups):
            if g["grad"] is None:
                continue
            if not skip:
                sq[i] += g["grad"].float().pow(2).sum().cpu()
                continue
            for p in g["params"]:
                if id(p) not in skip:
                    z = p._zero
                    sq[i] += g["grad"][z.master_offset:z.master_offset + z.chunk].float().pow(2).sum().cpu()
        comm.all_reduce(sq, group=self.group, label=label)
        return sq

    def global_grad_norm(self) -> float:
        return float(self._group_squares("stage3 grad norm").sum().sqrt())

    def norm_groups(self) -> List[torch.Tensor]:
        """DeepSpeed's stage-3 optimizer._get_norm_groups(): per param group, the norm of the
        gradients as they stand (loss-scaled under fp16), -1 where it is not finite. Collective."""
        self._flush_grads()
        norms = self._group_squares("stage3 norm groups").sqrt().to(self.ctx.device)
        return [torch.where(torch.isfinite(n), n, torch.full_like(n, -1.0)) for n in norms]

    def scale_gradients_(self, factor: float) -> None:
        if factor != 1.0:
            for g in self.groups:
                if g["grad"] is not None:
                    g["grad"].mul_(factor)

    def optimizer_step(self) -> None:
        self._prefetch.drop_all()  # no gather may still be reading a shard the step rewrites
        if self.muon is not None:
            self.muon.commit()  # the step is taken: this step's momentum stands
        for gi, g in enumerate(self.groups):
            # a 16-bit partition (grad_accum_dtype) is widened for the step only
            grad = self._grad(gi)
            g["master"].grad = grad if grad.dtype == g["master"].dtype else grad.to(g["master"].dtype)
        self.host.step()
        for g in self.groups:
            g["master"].grad = None
            for p in g["params"]:
                z = p._zero
                z.written()  # hpZ: the next forward gathers the new values from the primary shards
                new = g["master"][z.master_offset:z.master_offset + z.chunk]
                if z.swap is not None:  # a fresh tensor, queued for writing: the old value is never read
                    z.shard = new.to(device="cpu", dtype=p.dtype, copy=True)
                    rest([p], dirty=True)
                    continue
                if z.shard.data_ptr() != new.data_ptr():  # not when the shard is the master itself
                    z.shard.copy_(new)
            self._refresh_persistent(g["params"])

    def _refresh_persistent(self, params) -> None:
        """Parameters kept whole on every rank take their new value from every rank's shard:
        one all-gather for all of them (a model has many small ones: biases, norms)."""
        keep = [p for p in params if p._zero.persistent]
        by_kind: Dict[tuple, List[torch.nn.Parameter]] = {}
        for p in keep:
            by_kind.setdefault((p._zero.shard.dtype, p.device), []).append(p)
        for (dtype, device), ps in by_kind.items():
            local = torch.cat([p._zero.shard.to(device) for p in ps])
            out = torch.empty(self.world * local.numel(), dtype=dtype, device=device)
            comm.all_gather_into_tensor(out, local, group=self.group,
                                        label=f"stage3 refresh {len(ps)} persistent {ps[0]._zero.name}..")
            rows, off = out.view(self.world, -1), 0
            for p in ps:
                z = p._zero
                if is_present(p):  # else released by empty_partition_cache: its next use gathers the new shards
                    p.data.copy_(rows[:, off:off + z.chunk].reshape(-1)[:z.numel].view(z.shape))
                off += z.chunk

    def zero_grad(self) -> None:
        # no gradient is held between steps: the next reduce-scatter allocates the chunks again
        self._restarted = None
        if self.muon is not None:
            self.muon.discard()
        for g in self.groups:
            g["grad"] = None
            for p in g["params"]:
                p.grad = None

    def grad_partitions(self) -> Dict[int, List[torch.Tensor]]:
        """DeepSpeed's stage-3 `averaged_gradients`: per param group, this rank's averaged
        gradient partition of each trained parameter (ceil(numel / world) elements, the last
        rank's tail zero padding), views of the buffer the step reads, so a write is stepped.
        Empty for a group no backward has reached since the last step or zero_grad."""
        self._flush_grads()
        return {gi: [g["grad"][p._zero.master_offset:p._zero.master_offset + p._zero.chunk] for p in g["params"]]
                for gi, g in enumerate(self.groups) if g["grad"] is not None}

    def complete_reductions(self, what: str) -> None:
        """Every gradient reduction a backward started has landed in the partitions (each
        backward's own flush does it; a bucket a raised coalesce block left queued goes now)."""
        self._flush_grads()

    def _grad(self, gi: int) -> torch.Tensor:
        """Group gi's reduced-gradient chunks (beside its master, in grad_accum_dtype), zeroed
        when the step (zero_grad) freed them."""
        g = self.groups[gi]
        if g["grad"] is None:
            g["grad"] = pin_host(torch.zeros_like(g["master"], dtype=g["grad_dtype"]), g["pin"])
        return g["grad"]

    def shard_changed(self, p) -> None:
        z = p._zero
        if z.group_index >= 0:
            self.groups[z.group_index]["master"][z.master_offset:z.master_offset + z.chunk].copy_(z.shard)

    # -- whole-parameter access (zero/fragments.py) ---------------------------------------------
    # Each parameter's chunk sits at z.master_offset in its group's fp32 master, gradient and
    # optimizer state partitions (padded to z.chunk elements); whole values are all-gathered
    # over the data-parallel group, and a rank writing a whole value keeps its own chunk.
    def _chunk_of(self, param, part: str, key: Optional[str] = None) -> Optional[torch.Tensor]:
        """This rank's padded chunk of `param` in the group's "master" or "grad" partition,
        or of optimizer state `key` (part "master"); None for a parameter not stepped here."""
        z = getattr(param, "_zero", None)
        if z is None or z.owner is not self or z.group_index < 0 or not self.groups:
            return None
        gi = z.group_index
        if key is None:
            flat = self._grad(gi) if part == "grad" else self.groups[gi][part]
        else:
            flat = state_tensor(self.host.state_of(gi), key, z.name)
        return flat[z.master_offset:z.master_offset + z.chunk]

    def _all_gather_chunk(self, param, chunk: torch.Tensor, what: str) -> torch.Tensor:
        z = param._zero
        local = chunk.detach().to(self.ctx.device, torch.float32).contiguous()
        out = torch.empty(self.world * z.chunk, dtype=torch.float32, device=self.ctx.device)
        if self.ctx.distributed:
            comm.all_gather_into_tensor(out, local, group=self.group, label=f"{what} {z.name}")
        else:
            out.copy_(local)
        return out[:z.numel].view(z.shape)

    def _write_chunk(self, param, chunk_value: torch.Tensor, key: Optional[str]) -> None:
        """Write this rank's chunk (padded length) of the master or of state `key`; the
        master's value also goes to the compute-dtype shard, and to the whole module copy
        of a persistent or gathered parameter."""
        z = param._zero
        with torch.no_grad():
            if key is not None:
                state = self.host.state_of(z.group_index)
                state_tensor(state, key, z.name)[z.master_offset:z.master_offset + z.chunk] = \
                    chunk_value.to(torch.float32)
                self.host.write_state_of(z.group_index, state)
                return
            master = self.groups[z.group_index]["master"]
            master[z.master_offset:z.master_offset + z.chunk] = chunk_value.to(master.device, master.dtype)
            new = master[z.master_offset:z.master_offset + z.chunk]
            if z.shard.data_ptr() != new.data_ptr():
                z.shard.copy_(new)
            z.written()
            rest([param], dirty=True)

    def _refresh_whole(self, param, full: Optional[torch.Tensor]) -> None:
        """A whole module copy (persistent, or gathered right now) takes the new value."""
        if param.data.numel() == param._zero.numel and full is not None:
            with torch.no_grad():
                param.data.copy_(full.view(param._zero.shape).to(param.data.device, param.data.dtype))

    def full_hp(self, param, key=None):
        chunk = self._chunk_of(param, "master", key)
        if chunk is None:
            return None
        return self._all_gather_chunk(param, chunk, "safe_get_full_fp32_param" if key is None else key)

    def set_full_hp(self, param, value, key=None):
        if self._chunk_of(param, "master", key) is None:
            return
        z = param._zero
        flat = check_numel("safe_set_full_*", value, z.numel)
        sh = param_shard(z.numel, self.world, self.rank)
        mine = torch.zeros(z.chunk, dtype=torch.float32, device=flat.device)
        mine[:sh.numel] = flat[sh.start:sh.end]
        self._write_chunk(param, mine, key)
        if key is None:
            self._refresh_whole(param, flat)

    def full_grad(self, param):
        if self._chunk_of(param, "grad") is None:
            return None
        self.grads_for_access("safe_get_full_grad")
        return self._all_gather_chunk(param, self._chunk_of(param, "grad"), "safe_get_full_grad")

    def set_full_grad(self, param, value):
        chunk = self._chunk_of(param, "grad")
        if chunk is None:
            return
        z = param._zero
        flat = check_numel("safe_set_full_grad", value, z.numel)
        self.grads_for_access("safe_set_full_grad")
        sh = param_shard(z.numel, self.world, self.rank)
        with torch.no_grad():
            chunk.zero_()
            chunk[:sh.numel] = flat[sh.start:sh.end].to(chunk.device, chunk.dtype)

    def local_hp(self, param, key=None):
        chunk = self._chunk_of(param, "master", key)
        return None if chunk is None else chunk.detach().to(self.ctx.device, torch.float32, copy=True)

    def set_local_hp(self, param, value, key=None):
        if self._chunk_of(param, "master", key) is None:
            return
        z = param._zero
        flat = check_numel("safe_set_local_*", value, z.chunk)
        self._write_chunk(param, flat, key)
        if key is None and param.data.numel() == z.numel:  # a whole copy: this rank's piece of it
            sh = param_shard(z.numel, self.world, self.rank)
            with torch.no_grad():
                param.data.view(-1)[sh.start:sh.end] = flat[:sh.numel].to(param.data.device, param.data.dtype)

    def local_grad(self, param):
        if self._chunk_of(param, "grad") is None:
            return None
        self.grads_for_access("safe_get_local_grad")
        return self._chunk_of(param, "grad").detach().to(self.ctx.device, torch.float32, copy=True)

    def set_local_grad(self, param, value):
        chunk = self._chunk_of(param, "grad")
        if chunk is None:
            return
        flat = check_numel("safe_set_local_grad", value, param._zero.chunk)
        self.grads_for_access("safe_set_local_grad")
        with torch.no_grad():
            chunk.copy_(flat.to(chunk.device, chunk.dtype))

    def empty_partition_cache(self) -> None:
        """Free the full copy of every gathered parameter, prefetched and persistent ones too,
        as DeepSpeed's engine.empty_partition_cache does between phases (after the last step,
        before an evaluation or a checkpoint): the next forward gathers what it uses again."""
        self._prefetch.drop_all()
        release([p for p in self.module.parameters() if is_partitioned(p)], persistent=True)

    # -- checkpoints --------------------------------------------------------------------------
    def module_state_dict(self) -> Dict[str, torch.Tensor]:
        """Collective: every parameter gathered, the module's state_dict cloned."""
        params = [p for p in self.module.parameters() if is_partitioned(p)]
        was = [is_present(p) for p in params]
        gather(params)
        try:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        finally:
            # as found: a persistent parameter freed by empty_partition_cache is freed again
            release([p for p, w in zip(params, was) if not w], persistent=True)

    def load_module_state_dict(self, state: Dict[str, torch.Tensor], strict: bool = True) -> None:
        self._module_state = state
        params = dict(self.module.named_parameters())
        missing = [n for n in params if n not in state]
        if strict and missing:
            raise KeyError(f"checkpoint lacks parameters: {missing[:5]}")
        for n, p in params.items():
            if n in state and is_partitioned(p):
                z = p._zero
                src = state[n].reshape(-1)
                sh = param_shard(z.numel, self.world, self.rank)
                if z.packed is not None:  # int8 blocks: quantized again from the loaded value
                    new = torch.zeros(z.chunk, dtype=p.dtype, device=z.shard_device)
                    new[:sh.numel].copy_(src[sh.start:sh.end])
                    z.shard = new
                else:
                    z.shard.zero_()
                    z.shard[:sh.numel].copy_(src[sh.start:sh.end])
                z.written()
                if z.persistent and is_present(p):
                    p.data.copy_(src.view(z.shape))
                self.shard_changed(p)
                rest([p], dirty=True)
        # a tied parameter's second name (HF's lm_head.weight = wte.weight) is a parameter too
        names = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        buffers = {n: v for n, v in state.items() if n not in names}
        if buffers:
            self.module.load_state_dict(buffers, strict=False)

    def shard_layout(self) -> ShardLayout:
        # parameters live in the fp32 shards and every rank writes its own model file; DeepSpeed
        # refuses MoE with ZeRO-3, so there is no per-expert file layout to follow here
        return ShardLayout(ShardKind.PER_PARAMETER, self.stage, self.world, self.rank, frozen=FrozenRecord.FRAGMENT,
                           module_in_shards=True, own_model_file=True, records_tied=True, expert_files=False,
                           sub_group_size=int(self.ctx.config.zero_optimization.sub_group_size),
                           recuts=self.loads_any_world_size)

    def partition_state(self) -> Dict[str, Any]:
        groups = []
        for gi, g in enumerate(self.groups):
            m = g["master"]
            state = self.host.state_of(gi)
            groups.append({
                "pieces": pieces_to_dict(g["pieces"]), "shapes": g["shapes"],
                "master": {p.name: m[p.offset:p.offset + p.numel].clone() for p in g["pieces"]},
                "state": {k: ({p.name: v[p.offset:p.offset + p.numel].clone() for p in g["pieces"]}
                              if torch.is_tensor(v) and v.shape == m.shape and k != "step" else v)
                          for k, v in state.items()},
            })
        return {"format": "dslaunch-zero-shard/1", "stage": 3, "world_size": self.world, "rank": self.rank,
                "groups": groups}

    def load_shards(self, shards, load_optimizer: bool = True) -> None:
        for gi, g in enumerate(self.groups):
            want = [(p.name, p.start, p.end, p.offset) for p in g["pieces"]]
            assemble(shards, gi, "master", want, g["master"])
            if load_optimizer:
                state = {}
                for k in self.host.state_keys(gi, shards):
                    if k.tensor:
                        t = torch.zeros_like(g["master"], dtype=self.precision.optimizer_state)
                        assemble(shards, gi, ("state", k.name), want, t)
                        state[k.name] = t
                    else:
                        state[k.name] = k.value
                self.host.load_state_of(gi, state)
            for p in g["params"]:
                z = p._zero
                z.shard.copy_(g["master"][z.master_offset:z.master_offset + z.chunk])
                z.written()
                rest([p], dirty=True)
            self._refresh_persistent(g["params"])

    # -- engine.offload_states / reload_states (offload_states.py) --------------------------
    def _stepped(self):
        return [p for g in self.groups for p in g["params"]]

    def state_tensors(self, kind: OffloadStateTypeEnum) -> List[torch.Tensor]:
        """This rank's tensors of one offloadable kind. A shard that is a view of its master
        (parameters in the masters' dtype) is that master: they move together."""
        if kind == OffloadStateTypeEnum.hp_params:
            return [g["master"] for g in self.groups]
        if kind == OffloadStateTypeEnum.lp_params:
            out, masters = [], set()
            for p in self.module.parameters():
                z = getattr(p, "_zero", None)
                if z is None or z.owner is not self or z.packed is not None or z.resident is None:
                    continue  # int8-packed frozen shards stay where they are
                if id(p) in self._shard_is_master:
                    gi = z.group_index
                    if gi not in masters:
                        masters.add(gi)
                        out.append(self.groups[gi]["master"])
                else:
                    out.append(z.resident)
            return out
        if kind == OffloadStateTypeEnum.optim_states:
            return [v for g in self.groups for v in self.optimizer.state.get(g["master"], {}).values()
                    if torch.is_tensor(v)]
        if kind == OffloadStateTypeEnum.lp_grads:
            return [g["grad"] for g in self.groups if g["grad"] is not None]
        return []  # contiguous_grad_buffer: the reduce-scatter buckets exist only during backward

    def reseat_states(self) -> None:
        """After a move: a shard that shares its master's storage is a view of it again."""
        for p in self._stepped():
            if id(p) in self._shard_is_master:
                z = p._zero
                z.resident.data = self.groups[z.group_index]["master"][z.master_offset:z.master_offset + z.chunk]

    @contextlib.contextmanager
    def hooks_suspended(self):
        """No ZeRO hook runs inside (unwrap_model_for_generation: the caller holds the whole
        model gathered). The forward order recorded for prefetching is dropped on the way out:
        generation's forwards are not the training step's, and the next forward records anew."""
        self.remove_hooks()
        try:
            yield
        finally:
            self._prefetch.drop_all()
            self._trace, self._recording, self._trace_ok, self._index = [], True, False, None
            self.wrap_module()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._watches is not None:
            self._watches.remove()
            self._watches = None

    def close(self) -> None:
        self.remove_hooks()
        if self.host is not None:
            self.host.close()
        if self.swapper is not None:
            self.swapper.close()
            self.swapper = None


def _device(params):
    return params[0].device if params else torch.device("cpu")


_module_ids = itertools.count()


def _output_items(out) -> list:
    """Where a module's output can carry a parameter for DeepSpeed's dangling-parameter rule."""
    if isinstance(out, (list, tuple)):
        return list(out)
    if isinstance(out, dict):
        return list(out.values())
    if out is None or torch.is_tensor(out):
        return [out]
    try:
        return [v for k, v in vars(out).items() if not k.startswith("__")]
    except TypeError:  # no __dict__ (a number, a slotted object): nothing to look at
        return []


def _param_behind(x) -> Optional[torch.nn.Parameter]:
    """The partitioned parameter x is, or stands for (`ds_param_alias`: what _through returned
    for it), else None."""
    if isinstance(x, torch.nn.Parameter) and is_partitioned(x):
        return x
    return getattr(x, "ds_param_alias", None) if torch.is_tensor(x) else None


def _through(fn, engine, m, items) -> Optional[list]:
    """items, with those that are tensors needing a gradient passed through fn (one call for all
    of them); None when none needs one. What comes back for a partitioned parameter is a plain
    tensor: its `ds_param_alias` names the parameter, as DeepSpeed's does, so a module that
    returns it again (a parameter handed up two levels) still hands out the parameter."""
    idx = [i for i, x in enumerate(items) if torch.is_tensor(x) and x.requires_grad]
    if not idx:
        return None
    new = list(items)
    for i, w in zip(idx, fn.apply(engine, m, *[items[i] for i in idx])):
        p = _param_behind(items[i])
        if p is not None and w is not p:
            w.ds_param_alias = p
        new[i] = w
    return new


def _wrap_inputs(engine, m, args: tuple):
    """m's positional inputs, those that need a gradient passed through _PostBackward (None:
    none does, so nothing tells when m's backward ends)."""
    new = _through(_PostBackward, engine, m, args)
    return None if new is None else tuple(new)


def _wrap_outputs(engine, m, out):
    if torch.is_tensor(out):
        if out.requires_grad:
            return _PreBackward.apply(engine, m, out)[0]
        return out
    if isinstance(out, (tuple, list)):
        new = _through(_PreBackward, engine, m, out)
        if new is None:
            return out
        return type(out)(new) if isinstance(out, tuple) and type(out) is tuple else (tuple(new) if isinstance(out, tuple) else new)
    return out


def _norm_groups_of(strategy: ZeroStage3):
    # a weak reference: the optimizer object (the script's) must not keep the strategy alive
    ref = weakref.ref(strategy)

    def _get_norm_groups():
        s = ref()
        if s is None:
            raise RuntimeError("_get_norm_groups: the stage-3 engine that built this optimizer is gone")
        return s.norm_groups()

    return _get_norm_groups
