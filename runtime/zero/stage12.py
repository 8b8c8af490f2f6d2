"""ZeRO stages 1 and 2: master weights and optimizer state partitioned over the
data-parallel group (`ZeroStage1`, `ZeroStage2`: the engine strategies themselves). The
masters, the reduced gradient partitions and the optimizer state have the dtypes of the
precision policy (ctx.precision): fp32, or bf16 with bf16 master weights and states.

Each param group's trainable parameters are laid out flat (partition.FlatLayout); rank r
keeps only its contiguous partition of the fp32 masters, the optimizer state (the
user's own optimizer object, whose group "params" become the one partition tensor so LR
schedulers keep working) and, in stage 2, the gradients. The module's parameters become
views into one flat buffer per group so the post-step all-gather writes them in place.

Gradient flow:
  stage 1  grads accumulate in param.grad as usual; the boundary micro-step's backward
           reduces them as stage 2 does (below), overlapped with backward, into a
           partition (the policy's grad dtype) that lives until the step; no
           communication off the boundary. With data_types.grad_accum_dtype other
           than the model dtype, each backward's gradient moves at once from
           param.grad into param.grad_accum (in that dtype), as DeepSpeed's stage 1
           does, and the boundary reduces that sum, in the communication dtype
           (default: the model's, as DeepSpeed's).
  stage 2  grads are reduced to their owner during backward, bucket by bucket in
           reverse registration order (about the order backward produces them), and
           param.grad is freed at once; a rank accumulates only its partition. With
           overlap_comm the reduces are asynchronous: up to two buckets run behind the
           backward computing the earlier layers, and land in the partition after. Buckets
           are issued strictly in plan order so every rank issues the same collectives
           in the same sequence whatever order its hooks fire in. This happens on every
           micro-step (the price of keeping only a partition), as in DeepSpeed.
  both     the gradient partition is freed at the step (zero_grad) and allocated
           again by the next window's first reduce: between steps no gradient is held,
           as in DeepSpeed, so the next forward's activations have that room.

Each param group is partitioned over its own axis (ctx.axes: the data axis, or
expert_data for "moe" groups): its layout, its reduce-to-owner buckets (a bucket never
spans two axes) and its post-step all-gather use that axis's size, rank and group. The
global norm is still one all-reduce over the data group: expert_data x expert is the data
group, so it sums each expert's partitions over its replicas and then over the experts,
counting every parameter once.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from ..core.muon.sharded import MOMENTUM, ShardedMuon, flat_layout_updates, resident_keys, whole_momenta
from ..core.reduction import GradReduction, plan_buckets
from ..core.shard_state import FrozenRecord, ShardKind, ShardLayout
from ..core.strategy import DATA_AXIS, ReduceAxis, StrategyContext, check_numel, register_strategy, state_tensor
from ..core import comm
from .offload import OptimizerHost, make_host, pin_host
from .offload_states import StateMover
from ..core.config.zero import OffloadStateTypeEnum
from .partition import FlatLayout, Piece, pieces_to_dict
from .partition_views import publish_partitions
from .sharded import ShardedStrategy, offload_optimizer
from .reshard import assemble

_log = logging.getLogger("dslaunch.runtime")


@dataclass
class _Group:
    params: List[torch.nn.Parameter]
    names: List[str]
    layout: FlatLayout
    flat: torch.Tensor  # module-dtype full buffer; the params are views into it
    master: torch.Tensor  # the masters' partition (this rank's slice of the flat layout)
    grad: Optional[torch.Tensor]  # partition gradient in the policy's grad dtype (stage 2; stage 1 after reduce)
    pieces: List[Piece]
    axis: ReduceAxis  # what the group is partitioned over and its gradients reduced on
    master_is_view: bool = False  # the master is this rank's slice of `flat` (one copy, fp32 or bf16 masters)


@dataclass
class _Inflight:
    """One owner's share of a bucket, reduced asynchronously: what lands where once it is done."""

    bucket: int
    work: Optional[Any]  # the collective's handle (None: it ran synchronously)
    buf: torch.Tensor  # the packed share; on the owner, the sum once work is done
    spans: List[tuple]  # (group index, start, end in the slot, offset in the partition); empty off the owner


def named_trainable(module: torch.nn.Module) -> Dict[int, str]:
    """id(param) -> the first name module.named_parameters() gives it (tied weights
    appear once, under their first name)."""
    return {id(p): n for n, p in module.named_parameters()}


class _PartitionedStage(ShardedStrategy):
    """Stages 1 and 2 (`stage` is set by @register_strategy on the subclasses)."""

    _MAX_INFLIGHT = 2  # buckets whose reduces may run behind backward at once

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        z = ctx.config.zero_optimization
        module, optimizer = self.module, self.optimizer
        offload, sub_group_size = offload_optimizer(ctx), z.sub_group_size
        if offload is not None:
            ctx.refuse_foreign_axes(f"zero_optimization.offload_optimizer ({offload.device})")
        self.reduce_bucket = int(z.reduce_bucket_size)
        self.gather_bucket = int(z.allgather_bucket_size)
        self.overlap_comm = z.overlaps_reduction
        self.offload_device = getattr(offload, "device", "none") if offload is not None else "none"
        self.pin = bool(getattr(offload, "pin_memory", False))
        # summed in fp16: divided before the sum as DeepSpeed's reduce-scatter does (core/precision.py)
        divide_first = ctx.precision.sums_in_fp16 and z.reduce_scatter
        self.reduction = GradReduction.from_config(ctx.config, self.world, divide_first)
        self._reductions = {DATA_AXIS: self.reduction}
        for axis in ctx.axes:
            self._reductions.setdefault(axis.name, GradReduction.from_config(ctx.config, axis.average_over,
                                                                             divide_first))
        # the masters' dtype, and the reduced gradient partition's (stage 2: always; stage 1: from
        # the boundary backward to the step): the precision policy's
        self.precision = ctx.precision
        self.master_dtype, self.accum_dtype = ctx.precision.master, ctx.precision.grad
        # stage 1 with grad_accum_dtype other than the model's (any of fp32, bf16, fp16):
        # micro-batch sums in param.grad_accum, not in the model dtype's .grad
        accum = ctx.config.grad_accum_dtype
        self.separate_accum = accum if self.stage == 1 and accum not in (None, ctx.precision.compute) else None
        if self.separate_accum is not None and self.reduction.dtype is None:
            # on the wire in the model dtype, as DeepSpeed's default communication_data_type
            self.reduction = dataclasses.replace(self.reduction, dtype=ctx.precision.compute)
            self._reductions = {name: dataclasses.replace(r, dtype=ctx.precision.compute)
                                for name, r in self._reductions.items()}
        ctx.precision.check_optimizer(optimizer, offload is not None, self.stage)
        names = named_trainable(module)
        seen = set()
        self.groups: List[_Group] = []
        # every group's parameters as the user's optimizer listed them (frozen ones too):
        # how a stage-0 checkpoint's optimizer state is matched to names
        self.listed_names = [[names.get(id(p), "") for p in pg["params"]] for pg in optimizer.param_groups]
        for pg, axis in zip(optimizer.param_groups, ctx.axes):
            params = [p for p in pg["params"] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in params)
            self.groups.append(self._build_group(params, [names.get(id(p), f"<unnamed{id(p)}>") for p in params],
                                                 axis))
        for pg, g in zip(optimizer.param_groups, self.groups):
            pg["params"] = [g.master]
        if self.separate_accum is not None:
            for p in (p for g in self.groups for p in g.params):
                p.grad_accum = None  # DeepSpeed's attribute: the micro-batch sum, read by the boundary's reduce
        # DeepSpeed's name for this rank's master partition of each group, which scripts (and
        # its offload_states tests) read off engine.optimizer; the same tensor objects for the
        # engine's life (offload_states swaps their .data, never the objects)
        optimizer.single_partition_of_fp32_groups = [g.master for g in self.groups]
        publish_partitions(optimizer, self.groups)  # parallel_partitioned_bit16_groups, read live
        optimizer.state.clear()
        # Where the update runs: in place on the masters, on the CPU with the fused
        # kernel, or with state swapped to NVMe files.
        self.host: OptimizerHost = make_host(optimizer, [g.master for g in self.groups], offload, sub_group_size,
                                             resident_keys(ctx.config))
        # Muon: whole-matrix updates from the partitions, before the norm (muon/sharded.py)
        self.muon = ShardedMuon(optimizer, self.host, ctx.loss_scale) if ShardedMuon.applies(optimizer) else None
        # ignore_unused_parameters false: DeepSpeed checks, with offload_optimizer only, that every
        # trainable parameter got a gradient since the last step (its per-parameter norms under
        # CPU offload); _got_grad records whose hooks fired in the window
        self.check_unused = offload is not None and not z.ignore_unused_parameters
        self._got_grad: set = set()
        self._boundary = True
        self._holding = False  # inside engine.coalesce_grad_reduction(): gradients stay in param.grad
        self._hooks = []
        self._bucket_plan: List[List[tuple]] = []
        self._inflight: List[_Inflight] = []  # reduces issued by the hooks, not yet added to the partition
        self._reduced = self.stage == 2  # stage 1: set once the boundary backward has reduced
        self._install_hooks()
        self.optimizer_on_host = offload is not None  # offload_states leaves masters and state there
        self.mover = StateMover()  # what engine.offload_states moved (offload_states.py)

    # -- construction ---------------------------------------------------------------------
    def _build_group(self, params, names, axis: ReduceAxis) -> _Group:
        layout = FlatLayout.build([(n, tuple(p.shape)) for n, p in zip(names, params)], axis.size)
        dtype = params[0].dtype if params else torch.float32
        device = params[0].device if params else torch.device("cpu")
        flat = torch.zeros(layout.padded_total, dtype=dtype, device=device)
        # DeepSpeed's line (scripts and its tests watch for it); the buffer is always made on the
        # parameters' own device here, with no host fallback, so once allocated the memory sufficed
        _log.info(f"Flattening param group {len(self.groups)} on {device.type} (sufficient memory)")
        for p, s in zip(params, layout.slots):
            flat[s.offset:s.offset + s.numel].copy_(p.data.reshape(-1))
            p.data = flat[s.offset:s.offset + s.numel].view(s.shape)
        lo, hi = layout.partition_range(axis.rank)
        # offloaded: masters, optimizer state and (stage 2) the gradient partition in host memory
        host = torch.device("cpu") if self.offload_device in ("cpu", "nvme") else device
        master_is_view = host == device and dtype == self.master_dtype
        if master_is_view:
            # parameters in the masters' dtype (fp32, or bf16 with bf16 masters): this rank's slice of
            # them is the master, one copy (DeepSpeed keeps a second, equal one)
            master = flat[lo:hi]
        else:
            master = pin_host(flat[lo:hi].detach().to(host, self.master_dtype).clone(), self.pin)
        return _Group(list(params), list(names), layout, flat, master, None, layout.pieces(axis.rank), axis,
                      master_is_view=master_is_view)

    def _grad_partition(self, g: _Group) -> torch.Tensor:
        """The group's reduced-gradient partition, allocated (zeroed, beside the master) by the
        first reduce after the step freed it."""
        if g.grad is None:
            g.grad = pin_host(torch.zeros_like(g.master, dtype=self.accum_dtype), self.pin)
        return g.grad

    # -- stage 2: reduce to owner during backward ----------------------------------------
    def _install_hooks(self) -> None:
        items = []  # (group index, param index), reverse registration order
        for gi, g in enumerate(self.groups):
            for pi in range(len(g.params)):
                items.append((gi, pi))
        items.reverse()
        # buckets are planned within runs of one axis, so none spans two groups of ranks
        runs: List[List[tuple]] = []
        for it in items:
            if runs and self.groups[runs[-1][0][0]].axis.name == self.groups[it[0]].axis.name:
                runs[-1].append(it)
            else:
                runs.append([it])
        self._bucket_plan = []
        for run in runs:
            sizes = [self.groups[gi].layout.slots[pi].numel for gi, pi in run]
            self._bucket_plan += [[run[i] for i in b] for b in plan_buckets(sizes, self.reduce_bucket)]
        self._bucket_of = {}
        for bi, b in enumerate(self._bucket_plan):
            for it in b:
                self._bucket_of[it] = bi
        self._reset_buckets()
        for gi, g in enumerate(self.groups):
            for pi, p in enumerate(g.params):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(gi, pi)))

    def _reset_buckets(self) -> None:
        self._pending = [len(b) for b in self._bucket_plan]
        self._next_bucket = 0

    def _fold(self, p) -> None:
        """Move p.grad into p.grad_accum (separate_accum's dtype), adding to what is there."""
        if p.grad is None:
            return
        if p.grad_accum is None:
            p.grad_accum = p.grad.to(self.separate_accum)
        else:
            p.grad_accum.add_(p.grad.to(self.separate_accum))
        p.grad = None

    def _make_hook(self, gi, pi):
        def hook(param):
            if self.separate_accum is not None:
                self._fold(param)  # every backward, at once: the sum never rounds to the model dtype
            if self.check_unused:
                self._got_grad.add((gi, pi))
            if not self.overlap_comm or self._holding or (self.stage == 1 and not self._boundary):
                return
            bi = self._bucket_of[(gi, pi)]
            self._pending[bi] -= 1
            while self._next_bucket < len(self._bucket_plan) and self._pending[self._next_bucket] == 0:
                self._reduce_bucket(self._next_bucket, async_op=True)
                self._next_bucket += 1
        return hook

    def _reduce_bucket(self, bi: int, async_op: bool = False) -> None:
        """Sum this bucket's gradients over ranks into their owners' partitions. Each
        owner's share is packed contiguously and reduced to it (dist.reduce), so bytes on
        the wire match a reduce-scatter even though the bucket spans partitions. async_op
        (from the hooks, overlap_comm): the reduces run while backward computes the earlier
        layers; their sums are added to the partition when they land (_land), and at most
        _MAX_INFLIGHT buckets are in flight, so their buffers stay bounded."""
        by_owner: Dict[int, List[tuple]] = {}
        axis = self.groups[self._bucket_plan[bi][0][0]].axis
        for gi, pi in self._bucket_plan[bi]:
            g = self.groups[gi]
            self._grad_partition(g)  # exists from the window's first reduce (stage 1: the boundary's) to the step
            s = g.layout.slots[pi]
            p = g.params[pi]
            src = p.grad_accum if self.separate_accum is not None else p.grad
            gflat = src.reshape(-1) if src is not None else None
            P = g.layout.partition_size
            for r in g.layout.owner_ranks(s.name) if s.numel else []:
                a, b = max(r * P, s.offset), min((r + 1) * P, s.offset + s.numel)
                by_owner.setdefault(r, []).append((gi, gflat, a - s.offset, b - s.offset, a - r * P))
            p.grad = None  # no full gradient survives the bucket (stage 1: from the boundary backward on)
            if self.separate_accum is not None:
                p.grad_accum = None
        for owner in sorted(by_owner):
            parts = by_owner[owner]
            # reduced in the module's dtype like stage 0 (half the bytes in bf16), summed into the partition
            buf = torch.cat([gf[a:b] if gf is not None else
                             torch.zeros(b - a, dtype=self.separate_accum or self.groups[gi].flat.dtype,
                                         device=self.groups[gi].flat.device)
                             for gi, gf, a, b, _ in parts])
            buf = self._reductions[axis.name].outgoing(buf)
            # deepspeed.comm's own signature, the label from the block: DeepSpeed's tests swap
            # comm.reduce for a function of exactly that signature
            with comm.labelled(f"stage2 grads bucket {bi} to {owner}"):
                work = comm.reduce(buf, dst=comm.get_global_rank(axis.group, owner), group=axis.group,
                                   async_op=async_op)
            # the owner adds the sum into its partition; the others keep buf alive until the reduce is done
            spans = [(gi, a, b, off) for gi, _, a, b, off in parts] if owner == axis.rank else []
            self._inflight.append(_Inflight(bi, work if async_op else None, buf, spans))
        self._land(keep=self._MAX_INFLIGHT if async_op else 0)

    def _land(self, keep: int = 0) -> None:
        """Wait for the oldest reduces until those of at most `keep` buckets are in flight, adding
        each owner's sum into its partition, in the order they were issued."""
        landed = False
        while self._inflight and len({f.bucket for f in self._inflight}) > keep:
            f = self._inflight.pop(0)
            if f.work is not None:
                f.work.wait()
            pos = 0
            for gi, a, b, off in f.spans:
                grad = self.groups[gi].grad
                grad[off:off + b - a] += f.buf[pos:pos + b - a].to(grad.device, grad.dtype)
                pos += b - a
            landed = True
        if landed:
            comm.release_completed()  # the landed buffers go now, not at the next collective

    # -- boundary -------------------------------------------------------------------------
    def before_backward(self, is_boundary: bool) -> None:
        self._boundary = is_boundary

    def after_backward(self, is_boundary: bool) -> None:
        if is_boundary or (self.stage == 2 and not self._holding):
            self._flush_buckets()
            self._reduced = True

    def hold_reductions(self) -> None:
        self._holding = True

    def release_held_reductions(self, reduce: bool) -> None:
        # autograd summed every held backward into param.grad; the buckets read it from there
        self._holding = False
        if reduce:
            self._flush_buckets()
        # not reduced: the next boundary backward's flush, or the step's, reduces param.grad
        self._reduced = reduce

    def _flush_buckets(self) -> None:
        """Reduce the buckets not yet complete (unused params, or overlap_comm off), in plan
        order, and land every reduce still in flight."""
        if self.separate_accum is not None:
            for g in self.groups:  # a .grad the hooks did not see (set by hand) joins the sum
                for p in g.params:
                    self._fold(p)
        while self._next_bucket < len(self._bucket_plan):
            self._reduce_bucket(self._next_bucket)
            self._next_bucket += 1
        self._land()
        self._reset_buckets()

    def _check_unused(self) -> None:
        """ignore_unused_parameters false: stop when a trainable parameter got no gradient since
        the last step (AssertionError, DeepSpeed's type for it); the window starts again."""
        got, self._got_grad = self._got_grad, set()
        unused = [g.names[pi] for gi, g in enumerate(self.groups) for pi in range(len(g.params))
                  if (gi, pi) not in got]
        if unused:
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            raise AssertionError(f"ZeRO stage {self.stage}: parameters got no gradient in this step ({shown}): "
                                 "set zero_optimization.ignore_unused_parameters to true, or make every trainable "
                                 "parameter contribute to the loss")

    def reduce_gradients(self) -> None:
        if self.check_unused:
            self._check_unused()
        if not self._reduced:  # stage 1 with no boundary backward seen: reduce what param.grad holds now
            self._flush_buckets()
        for g in self.groups:
            if g.grad is not None:
                self._reductions[g.axis.name].finish_(g.grad)
        self._reduced = self.stage == 2
        if self.muon is not None:
            self._muon_updates()

    def _muon_updates(self) -> None:
        """Each Muon group's gradient partition becomes its orthogonalised update."""
        for gi in self.muon.groups():
            g = self.groups[gi]
            if g.params:
                flat_layout_updates(self.muon, gi, self._grad_partition(g), g.master, g.layout, g.pieces, g.axis,
                                    self.ctx.communicates(g.axis))

    def global_grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float32, device=self.groups[0].master.device if self.groups else "cpu")
        skip = self._excluded_names()
        for g in self.groups:
            if g.grad is None:
                continue
            if not skip:
                sq += g.grad.float().pow(2).sum()
                continue
            for piece in g.pieces:  # padding is zero: the pieces hold every element that counts
                if piece.name not in skip:
                    sq += g.grad[piece.offset:piece.offset + piece.numel].float().pow(2).sum()
        comm.all_reduce(sq, group=self.group, label=f"stage{self.stage} grad norm")
        return float(sq.sqrt())

    def sum_param_grads_(self, params, group) -> None:
        """Each parameter's whole reduced gradient is rebuilt from every data-parallel
        rank's pieces (one all-reduce of disjoint pieces), summed over `group`, and this
        rank's pieces written back. Every rank of the group calls it with the same list."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        slots = {s.name: (g, s) for g in self.groups for s in g.layout.slots}
        for p in params:
            g, slot = slots[names[id(p)]]
            full = torch.zeros(slot.numel, dtype=torch.float32, device=g.master.device)
            mine = [piece for piece in g.pieces if piece.name == slot.name]
            grad = self._grad_partition(g)
            for piece in mine:
                full[piece.start:piece.end] += grad[piece.offset:piece.offset + piece.numel]
            comm.all_reduce(full, group=g.axis.group, label=f"tied grad {slot.name} (data parallel)")
            comm.all_reduce(full, group=group, label=f"tied grad {slot.name}")
            for piece in mine:
                grad[piece.offset:piece.offset + piece.numel].copy_(full[piece.start:piece.end])

    def scale_gradients_(self, factor: float) -> None:
        if factor != 1.0:
            for g in self.groups:
                if g.grad is not None:
                    g.grad.mul_(factor)

    def optimizer_step(self) -> None:
        if self.muon is not None:
            self.muon.commit()  # the step is taken: this step's momentum stands
        for g in self.groups:
            # a 16-bit partition (grad_accum_dtype) is widened for the step only
            g.master.grad = (g.grad if g.grad.dtype == g.master.dtype else g.grad.to(g.master.dtype)) \
                if g.grad is not None else torch.zeros_like(g.master)
        self.host.step()
        for g in self.groups:
            g.master.grad = None
        self.sync_params()

    def sync_params(self) -> None:
        """All-gather the updated partitions into the module's flat buffers, in column
        buckets of allgather_bucket_size elements."""
        for g in self.groups:
            P, world = g.layout.partition_size, g.axis.size
            rows = g.flat.view(world, P)
            cols = max(1, self.gather_bucket // world)
            for c in range(0, P, cols):
                shard = g.master[c:c + cols].to(g.flat.device, g.flat.dtype)
                out = torch.empty(world * shard.numel(), dtype=g.flat.dtype, device=g.flat.device)
                comm.all_gather_into_tensor(out, shard, group=g.axis.group,
                                            label=f"stage{self.stage} params cols {c}")
                rows[:, c:c + shard.numel()].copy_(out.view(world, -1))

    def zero_grad(self) -> None:
        # nothing of the gradients is held between steps: the next reduce allocates the partition again
        if self.muon is not None:
            self.muon.discard()  # a skipped step's momentum (a taken step's was committed)
        for g in self.groups:
            for p in g.params:
                p.grad = None
                if self.separate_accum is not None:
                    p.grad_accum = None
            g.grad = None
        self._reduced = self.stage == 2

    # -- whole-parameter access (zero/fragments.py) -------------------------------------------
    # A parameter's flat range may straddle ranks: each rank holds the pieces of it that fall
    # in its partition. Reading fills those pieces into a zero buffer and sums it over the
    # group's axis (the pieces are disjoint); writing takes the whole value on every rank and
    # keeps the pieces this rank owns.
    def _slot(self, param):
        """(group, slot, this rank's pieces of it) for a trainable parameter, else None."""
        if not hasattr(self, "_slot_of"):
            self._slot_of = {id(p): (g, s) for g in self.groups for p, s in zip(g.params, g.layout.slots)}
        found = self._slot_of.get(id(param))
        if found is None:
            return None
        g, s = found
        return g, s, [piece for piece in g.pieces if piece.name == s.name]

    def _state_partition(self, g: _Group, key: str, name: str) -> torch.Tensor:
        return state_tensor(self.host.state_of(self.groups.index(g)), key, name)

    def _gather_pieces(self, g: _Group, s, mine, part: torch.Tensor, what: str) -> torch.Tensor:
        full = torch.zeros(s.numel, dtype=torch.float32, device=self.ctx.device)
        for piece in mine:
            full[piece.start:piece.end] = part[piece.offset:piece.offset + piece.numel].to(full.device, full.dtype)
        if self.ctx.communicates(g.axis):
            comm.all_reduce(full, group=g.axis.group, label=f"{what} {s.name}")
        return full.view(s.shape)

    def _scatter_pieces(self, mine, part: torch.Tensor, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for piece in mine:
                part[piece.offset:piece.offset + piece.numel] = flat[piece.start:piece.end].to(part.device, part.dtype)

    def full_hp(self, param, key=None):
        found = self._slot(param)
        if found is None:
            return None
        g, s, mine = found
        part = g.master if key is None else self._state_partition(g, key, s.name)
        return self._gather_pieces(g, s, mine, part, "safe_get_full_fp32_param" if key is None else key)

    def set_full_hp(self, param, value, key=None):
        found = self._slot(param)
        if found is None:
            return
        g, s, mine = found
        flat = check_numel("safe_set_full_*", value, s.numel)
        if key is not None:
            gi = self.groups.index(g)
            state = self.host.state_of(gi)
            self._scatter_pieces(mine, state_tensor(state, key, s.name), flat)
            self.host.write_state_of(gi, state)
            return
        self._scatter_pieces(mine, g.master, flat)
        with torch.no_grad():  # the module's copy (every rank holds it whole) follows at once
            g.flat[s.offset:s.offset + s.numel].copy_(flat.to(g.flat.device, g.flat.dtype))

    def full_grad(self, param):
        found = self._slot(param)
        if found is None:
            return None
        if self.local_grads_readable and not self.grad_window_open:  # DeepSpeed's answer inside no_sync
            return param.grad_accum if self.separate_accum is not None else param.grad
        self.grads_for_access("safe_get_full_grad")
        g, s, mine = found
        if g.grad is None:  # no gradient reached the group on any rank: zeros, as the step would see
            return torch.zeros(s.shape, dtype=torch.float32, device=self.ctx.device)
        return self._gather_pieces(g, s, mine, g.grad, "safe_get_full_grad")

    def set_full_grad(self, param, value):
        found = self._slot(param)
        if found is None:
            return
        g, s, mine = found
        flat = check_numel("safe_set_full_grad", value, s.numel)
        self.grads_for_access("safe_set_full_grad")
        self._scatter_pieces(mine, self._grad_partition(g), flat)

    # -- checkpoints ------------------------------------------------------------------------
    def shard_layout(self) -> ShardLayout:
        return ShardLayout(ShardKind.FLAT, self.stage, self.world, self.rank, frozen=self.frozen_record,
                           records_tied=True, recuts=self.loads_any_world_size)

    def partition_state(self) -> Dict[str, Any]:
        """This rank's pieces of masters and optimizer state, keyed by parameter name."""
        groups = []
        for gi, g in enumerate(self.groups):
            state = self.host.state_of(gi)
            groups.append({
                "axis_size": g.axis.size, "axis_rank": g.axis.rank,  # "moe" groups: expert_data's
                "pieces": pieces_to_dict(g.pieces),
                "shapes": {s.name: list(s.shape) for s in g.layout.slots},
                "master": {p.name: g.master[p.offset:p.offset + p.numel].clone() for p in g.pieces},
                "state": {k: ({p.name: v[p.offset:p.offset + p.numel].clone() for p in g.pieces}
                              if torch.is_tensor(v) and v.numel() == g.master.numel() else v)
                          for k, v in state.items()},
            })
            if self.muon is not None and gi in self.muon.groups() and torch.is_tensor(state.get(MOMENTUM)) and \
                    self.offload_device == "none":
                # DeepSpeed's layout on disk: the whole momentum of each matrix the partition touches
                # (its CPU-offload path keeps the momentum over the partition, as the shard does)
                groups[-1]["whole_state"] = {MOMENTUM: whole_momenta(state[MOMENTUM], g.layout, g.pieces, g.axis,
                                                                     self.ctx.communicates(g.axis), self.ctx.device)}
        return {"format": "dslaunch-zero-shard/1", "stage": self.stage, "world_size": self.world,
                "rank": self.rank, "groups": groups}

    def load_shards(self, shards: List[Dict[str, Any]], load_optimizer: bool = True) -> None:
        """Fill this rank's partition from the pieces of any number of saved shards (any
        world size, stage 1, 2 or 3); then all-gather so module params match."""
        for gi, g in enumerate(self.groups):
            want = [(p.name, p.start, p.end, p.offset) for p in g.pieces]
            assemble(shards, gi, "master", want, g.master)
            if load_optimizer:
                keys = self.host.state_keys(gi, shards)
                state = {}
                for k in keys:
                    if k.tensor:  # moments in the policy's optimizer-state dtype
                        t = torch.zeros_like(g.master, dtype=self.precision.optimizer_state)
                        assemble(shards, gi, ("state", k.name), want, t)
                        state[k.name] = t
                    else:
                        state[k.name] = k.value
                self.host.load_state_of(gi, state)
        self.sync_params()

    # -- engine.offload_states / reload_states (offload_states.py) --------------------------
    def state_tensors(self, kind: OffloadStateTypeEnum) -> List[torch.Tensor]:
        """This rank's tensors of one offloadable kind. A master that is a slice of the flat
        parameter buffer is that buffer (moved whole, then re-seated by reseat_states)."""
        if kind == OffloadStateTypeEnum.hp_params:
            return [g.flat if g.master_is_view else g.master for g in self.groups]
        if kind == OffloadStateTypeEnum.lp_params:
            return [g.flat for g in self.groups]
        if kind == OffloadStateTypeEnum.optim_states:
            return [v for g in self.groups for v in self.optimizer.state.get(g.master, {}).values()
                    if torch.is_tensor(v)]
        if kind == OffloadStateTypeEnum.lp_grads:
            return [g.grad for g in self.groups if g.grad is not None]
        return []  # contiguous_grad_buffer: the reduce buckets exist only during backward

    def reseat_states(self) -> None:
        """After a move: the parameters (and a master sharing it) are views of the flat buffer again."""
        for g in self.groups:
            for p, s in zip(g.params, g.layout.slots):
                p.data = g.flat[s.offset:s.offset + s.numel].view(s.shape)
            if g.master_is_view:
                lo, hi = g.layout.partition_range(g.axis.rank)
                g.master.data = g.flat[lo:hi]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self.host.close()

    # -- module state ---------------------------------------------------------------------------
    def load_module_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        self._module_state = state
        # the module's params are views into flat buffers: copy in place to keep them so
        with torch.no_grad():
            self.module.load_state_dict(state, strict=strict)
        for g in self.groups:
            lo, hi = g.layout.partition_range(g.axis.rank)
            g.master.copy_(g.flat[lo:hi])


@register_strategy(1)
class ZeroStage1(_PartitionedStage):
    """Optimizer state partitioned; full gradients until the boundary reduce-scatter."""

    frozen_record = FrozenRecord.NONE  # DeepSpeed's stage 1 records no frozen parameters


@register_strategy(2)
class ZeroStage2(_PartitionedStage):
    """Optimizer state and gradients partitioned; gradients reduced during backward."""

    frozen_record = FrozenRecord.WHOLE  # DeepSpeed's stage 2 keeps each frozen tensor whole

    communicates_every_micro_step = True
