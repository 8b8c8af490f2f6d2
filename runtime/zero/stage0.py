"""Stage 0: plain data parallelism with bucketed, overlapped gradient all-reduce.

Every rank keeps the whole model and optimizer. Gradients live in flat per-bucket buffers
(each parameter's .grad is a view into its bucket), so autograd accumulates straight into
the memory that is all-reduced: no copy in, no copy out. Buckets are filled in reverse
parameter order (roughly the order backward produces gradients) up to
`reduce_bucket_size` elements. On the boundary micro-step a post-accumulate-grad hook
counts ready parameters and launches an asynchronous all-reduce as soon as a bucket is
complete, while backward keeps computing the earlier layers (`overlap_comm`). Non-boundary
micro-steps only accumulate locally: no communication at all.

Between optimizer steps no gradient is held: zero_grad (at the step) frees every bucket's
storage and sets .grad to None, as DeepSpeed does, so the next forward's activations have
that room; the next window's first backward allocates the buckets again, zeroed.

With fp16/bf16 the module holds 16-bit weights and this strategy keeps fp32 master copies,
rewiring the optimizer's param groups to them; reduced 16-bit gradients are converted to
fp32 once per step, bucket by bucket, each 16-bit bucket freed once converted (param.grad
is None from then until zero_grad), and updated masters are copied back into the module.

Each parameter reduces over its own axis (expert_data for a "moe" param group and for an
expert's parameter in any group, else the data axis): a bucket never mixes axes, and is
all-reduced on its axis's group and averaged by its axis's size. Expert parameters differ across the expert axis, so
the global norm sums their squares over it.

Gradient hooks fire in autograd order, which is the same on every rank for the same
graph; a parameter that gets no gradient leaves its bucket to be reduced at the step,
also in the same order everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..core import comm
from ..core.errors import CheckpointError
from ..core.reduction import GradReduction
from ..core.shard_state import SavedShards, ShardKind, ShardLayout
from ..core.strategy import (DATA_AXIS, EXPERT_DATA_AXIS, GradientStrategy, ReduceAxis, StrategyContext, check_numel,
                             register_strategy, state_tensor)
from .reshard import whole_optimizer_state


@dataclass
class _Bucket:
    params: List[torch.nn.Parameter]
    flat: torch.Tensor  # gradients, in the module's dtype
    views: List[torch.Tensor]
    ready: int = 0
    work: Optional[object] = None
    wire: Optional[torch.Tensor] = None  # what the collective sums: `flat`, or its copy in communication_data_type
    index: int = 0  # position in the strategy's bucket list (named in comm records)
    master_flat: Optional[torch.Tensor] = None  # fp32 gradients (mixed precision only)
    masters: List[torch.Tensor] = field(default_factory=list)
    axis: Optional[ReduceAxis] = None  # the axis every parameter of the bucket reduces over


@register_strategy(0)
class DataParallelStrategy(GradientStrategy):
    loads_any_world_size = True  # a ZeRO checkpoint's shards (any stage, any world size) load here

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        # each optimizer group's parameters by name (before masters replace them): how
        # a ZeRO checkpoint's shards, keyed by name, are matched to this optimizer
        self._first_name = {id(p): n for n, p in self.module.named_parameters()}
        self._trainable = {n for n, p in self.module.named_parameters() if p.requires_grad}
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        self._group_names = [[self._first_name.get(id(p)) for p in g["params"]] for g in groups]
        seen = set()
        params = []
        for p in self.module.parameters():
            # no optimizer (forward only, as DeepSpeed allows at stage 0): no buckets, hooks or masters
            if self.optimizer is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        self.params = params
        self.mixed = ctx.compute_dtype != torch.float32
        self.overlap = ctx.config.zero_optimization.overlaps_reduction and ctx.distributed
        self._boundary = False
        self._hooks = []
        self.reduction = GradReduction.from_config(ctx.config, ctx.world_size)
        # id(param) -> its axis: its param group's ("moe" groups: expert_data), and for an expert's
        # parameter (`allreduce = False`) in any other group expert_data too, as DeepSpeed's stage 0
        # reduces each parameter by what it is: a script's own optimizer may hold experts and
        # shared parameters in one group
        by_group = ctx.axis_for_params()
        self._axis_of = {id(p): ctx.axis(EXPERT_DATA_AXIS) if getattr(p, "allreduce", True) is False
                         and by_group.get(id(p), ctx.data_axis).name == DATA_AXIS
                         else by_group.get(id(p), ctx.data_axis) for p in params}
        self._reductions = {DATA_AXIS: self.reduction}
        for axis in [*ctx.axes, *self._axis_of.values()]:
            self._reductions.setdefault(axis.name, GradReduction.from_config(ctx.config, axis.average_over))
        self.buckets = self._make_buckets(params, max(1, ctx.config.zero_optimization.reduce_bucket_size))
        self.bucket_of: Dict[int, _Bucket] = {}
        self.view_of: Dict[int, torch.Tensor] = {}
        for b in self.buckets:
            for p, v in zip(b.params, b.views):
                self.bucket_of[id(p)] = b
                self.view_of[id(p)] = v
                p.grad = v
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        if self.mixed and self.optimizer is not None:
            self._make_masters()

    # -- set-up ----------------------------------------------------------------------------
    def _axis(self, p) -> ReduceAxis:
        return self._axis_of.get(id(p)) or self.ctx.data_axis

    def _make_buckets(self, params, limit: int) -> List[_Bucket]:
        buckets, current, size = [], [], 0
        for p in reversed(params):
            if current and (size + p.numel() > limit or p.dtype != current[0].dtype or p.device != current[0].device
                            or self._axis(p).name != self._axis(current[0]).name):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        if current:
            buckets.append(current)
        out = []
        for group in buckets:
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
            views, off = [], 0
            for p in group:
                views.append(flat[off:off + p.numel()].view_as(p))
                off += p.numel()
            out.append(_Bucket(params=group, flat=flat, views=views, index=len(out), axis=self._axis(group[0])))
        return out

    def _make_masters(self) -> None:
        master_of = {}
        for b in self.buckets:
            b.masters = [p.detach().to(torch.float32).clone() for p in b.params]
            for p, m in zip(b.params, b.masters):
                master_of[id(p)] = m
        self.masters = [m for b in self.buckets for m in b.masters]
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) in master_of:
                    # state an optimizer made for the 16-bit parameter (torch's Adagrad fills its
                    # sums at construction) would outlive it, keyed by a tensor no group holds,
                    # and break state_dict(); the master's state starts at its first step
                    self.optimizer.state.pop(p, None)
            group["params"] = [master_of.get(id(p), p) for p in group["params"]]

    # -- backward --------------------------------------------------------------------------
    def _relink(self, p) -> None:
        # A user's model.zero_grad(set_to_none=True) detaches .grad from its bucket view.
        view = self.view_of[id(p)]
        if p.grad is not view:
            if p.grad is not None:
                view.copy_(p.grad)
            else:
                view.zero_()
            p.grad = view

    def _on_grad_ready(self, p) -> None:
        if not (self._boundary and self.overlap):
            return
        self._relink(p)
        b = self.bucket_of[id(p)]
        b.ready += 1
        if b.ready == len(b.params) and self.ctx.communicates(b.axis):
            b.wire = self._reductions[b.axis.name].outgoing(b.flat)
            b.work = comm.all_reduce(b.wire, group=b.axis.group, async_op=True,
                                     label=f"stage0 grads bucket {b.index}")

    def _ensure_grads(self) -> None:
        """Gradient buckets are freed at the step (zero_grad) so nothing of them is held between
        steps; the first backward of the next window (or a step or gradient access with no
        backward through the engine) allocates them again, zeroed, and points every .grad at its
        view (a gradient autograd made meanwhile is copied in)."""
        for b in self.buckets:
            if b.flat.untyped_storage().nbytes() == 0 and b.flat.numel():  # freed (zero_grad, or mixed precision's reduce)
                b.flat.untyped_storage().resize_(b.flat.numel() * b.flat.element_size())
                b.flat.zero_()
                for p, view in zip(b.params, b.views):
                    if p.grad is None:
                        p.grad = view  # zeroed with the bucket
                    else:
                        self._relink(p)

    def before_backward(self, is_boundary: bool) -> None:
        self._ensure_grads()
        self._boundary = is_boundary
        if is_boundary:
            for b in self.buckets:
                b.ready, b.work = 0, None

    # -- boundary --------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        self._ensure_grads()
        for b in self.buckets:
            if b.work is None:
                for p in b.params:
                    self._relink(p)
                if self.ctx.communicates(b.axis):
                    b.wire = self._reductions[b.axis.name].outgoing(b.flat)
                    comm.all_reduce(b.wire, group=b.axis.group, label=f"stage0 grads bucket {b.index}")
                elif b.axis.average_over != b.axis.size:  # experts alone on their axis: still divided
                    b.wire = self._reductions[b.axis.name].outgoing(b.flat)
            else:
                b.work.wait()
                b.work = None
            if b.wire is not None:
                self._reductions[b.axis.name].finish_(b.wire)
                if b.wire is not b.flat:  # summed in another dtype: back where the gradients live
                    b.flat.copy_(b.wire)
                b.wire = None
            if self.mixed:
                b.master_flat = b.flat.to(torch.float32)
                off = 0
                for m in b.masters:
                    m.grad = b.master_flat[off:off + m.numel()].view_as(m)
                    off += m.numel()
                # the 16-bit bucket is spent: free it until zero_grad, so a full 16-bit copy never
                # sits beside the full fp32 one (at most one bucket of both at a time)
                for p in b.params:
                    p.grad = None
                b.flat.untyped_storage().resize_(0)
        self._boundary = False

    def _grad_flats(self) -> List[torch.Tensor]:
        return [b.master_flat if self.mixed else b.flat for b in self.buckets]

    def _reduced_grad(self, b: _Bucket, i: int) -> torch.Tensor:
        return b.masters[i].grad if self.mixed else b.views[i]

    def global_grad_norm(self) -> float:
        # Stage 0 gradients are identical on every rank after the all-reduce: no communication,
        # except for parameters that differ across the expert axis (experts): their squares sum there.
        experts = self.ctx.expert_axis()
        if experts is not None and any(b.axis.name != DATA_AXIS for b in self.buckets):
            return self._norm_with_experts(experts)
        skip = self.ctx.norm_exclude
        if skip:
            parts = [self._reduced_grad(b, i) for b in self.buckets for i, p in enumerate(b.params)
                     if id(p) not in skip]
        else:
            parts = self._grad_flats()
        if not parts:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(f.float(), 2) for f in parts])
        return float(torch.linalg.vector_norm(norms, 2))

    def _norm_with_experts(self, experts: ReduceAxis) -> float:
        skip = self.ctx.norm_exclude
        sq = {True: torch.zeros((), dtype=torch.float32), False: torch.zeros((), dtype=torch.float32)}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if id(p) not in skip:
                    sq[b.axis.name == DATA_AXIS] += self._reduced_grad(b, i).float().pow(2).sum().cpu()
        other = sq[False].to(self.ctx.device)
        comm.all_reduce(other, group=experts.group, label="stage0 grad norm over experts")
        return float((sq[True] + other.cpu()).sqrt())

    def sum_param_grads_(self, params, group) -> None:
        for p in params:
            b = self.bucket_of[id(p)]
            i = next(i for i, q in enumerate(b.params) if q is p)
            comm.all_reduce(self._reduced_grad(b, i), group=group, label="tied grad")

    def scale_gradients_(self, factor: float) -> None:
        for f in self._grad_flats():
            f.mul_(factor)

    def optimizer_step(self) -> None:
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for b in self.buckets:
                    torch._foreach_copy_(b.params, b.masters)

    def zero_grad(self) -> None:
        # every bucket freed (mixed precision: already, by reduce_gradients); see _ensure_grads
        for b in self.buckets:
            b.flat.untyped_storage().resize_(0)
            b.master_flat = None
            for p in b.params:
                p.grad = None
            for m in b.masters:
                m.grad = None

    # -- whole-parameter access (zero/fragments.py): every rank holds every parameter whole --
    def _place(self, p):
        """(bucket, index) of a trainable parameter; None for a frozen one."""
        b = self.bucket_of.get(id(p))
        return None if b is None else (b, next(i for i, q in enumerate(b.params) if q is p))

    def _master(self, p) -> Optional[torch.Tensor]:
        """The tensor the optimizer steps for `p`: its fp32 master, or `p` itself in fp32."""
        place = self._place(p)
        if place is None:
            return None
        b, i = place
        return b.masters[i] if self.mixed else p

    def full_hp(self, param, key=None):
        m = self._master(param)
        if m is None:
            return None
        src = m if key is None else state_tensor(self.optimizer.state.get(m, {}), key, self._first_name[id(param)])
        return src.detach().to(self.ctx.device, torch.float32, copy=True).view(param.shape)

    def set_full_hp(self, param, value, key=None):
        m = self._master(param)
        if m is None:
            return
        flat = check_numel("safe_set_full_*", value, param.numel())
        with torch.no_grad():
            if key is not None:
                state_tensor(self.optimizer.state.get(m, {}), key, self._first_name[id(param)]) \
                    .view(-1).copy_(flat)
                return
            m.view(-1).copy_(flat)
            if m is not param:  # the module's low-precision copy follows its master at once
                param.data.view(-1).copy_(flat)

    def full_grad(self, param):
        place = self._place(param)
        if place is None:
            return None
        if self.local_grads_readable and not self.grad_window_open:
            return param.grad  # DeepSpeed's answer inside no_sync: param.grad itself
        self.grads_for_access("safe_get_full_grad")
        return self._reduced_grad(*place).detach().to(self.ctx.device, torch.float32, copy=True).view(param.shape)

    def set_full_grad(self, param, value):
        place = self._place(param)
        if place is None:
            return
        flat = check_numel("safe_set_full_grad", value, param.numel())
        self.grads_for_access("safe_set_full_grad")
        with torch.no_grad():
            self._reduced_grad(*place).view(-1).copy_(flat)

    # -- checkpoints -----------------------------------------------------------------------
    def load_module_state_dict(self, state, strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)
        if self.mixed:
            with torch.no_grad():
                for b in self.buckets:
                    for p, m in zip(b.params, b.masters):
                        m.copy_(p.detach().to(torch.float32))

    def optimizer_state_dict(self):
        # parameter names (each group's, and the masters' order) let another topology or
        # stage re-cut this state by name (checkpoint/parallel.py, reshard.shards_from_stage0)
        state = {"optimizer": self.optimizer.state_dict(), "param_names": self._group_names}
        if self.mixed:
            state["fp32_masters"] = [m.detach().clone() for m in self.masters]
            state["master_names"] = [self._first_name[id(p)] for b in self.buckets for p in b.params]
        return state

    def shard_layout(self) -> ShardLayout:
        return ShardLayout(ShardKind.WHOLE, self.stage, self.ctx.world_size, self.ctx.rank,
                           recuts=self.loads_any_world_size)

    def load_shard_state(self, saved: SavedShards) -> None:
        """A whole state: torch's state_dict, then the fp32 copies (DeepSpeed's fp32_groups
        order, param group by param group) into the fp32 tensors the optimizer steps; ZeRO
        shards (any stage, any world size): re-cut into whole tensors."""
        if not saved.is_whole:
            self.load_optimizer_state_dict(saved.shards)
            return
        self.optimizer.load_state_dict(saved.whole["optimizer"])
        masters = saved.whole.get("fp32_masters")
        if masters:
            targets = [p for g in self.optimizer.param_groups for p in g["params"]]
            if len(targets) != len(masters) or any(t.shape != m.shape for t, m in zip(targets, masters)):
                raise CheckpointError("the checkpoint's fp32 weights do not match this optimizer's parameters")
            with torch.no_grad():
                for t, m in zip(targets, masters):
                    if t.dtype == torch.float32:
                        t.copy_(m)

    def load_optimizer_state_dict(self, state) -> None:
        if isinstance(state, list):
            state = self._state_from_zero_shards(state)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.mixed and "fp32_masters" in state:
            with torch.no_grad():
                for m, saved in zip(self.masters, state["fp32_masters"]):
                    m.copy_(saved)

    def _state_from_zero_shards(self, shards):
        """Every saved rank's ZeRO shard re-cut into whole tensors, in the form
        optimizer_state_dict() returns: a torch optimizer state_dict (plus fp32 masters)."""
        saved = self.optimizer.state_dict()  # current hyperparameters and parameter indices
        numels = {}
        for pg, names in zip(self.optimizer.param_groups, self._group_names):
            for p, name in zip(pg["params"], names):
                if name in self._trainable:  # frozen parameters have no ZeRO shard
                    numels[name] = p.numel()
        masters, states = whole_optimizer_state(shards, numels)
        opt_state = {}
        for pg, spg, names in zip(self.optimizer.param_groups, saved["param_groups"], self._group_names):
            for p, idx, name in zip(pg["params"], spg["params"], names):
                if name in states and states[name]:
                    opt_state[idx] = {k: (v.view_as(p) if torch.is_tensor(v) and v.numel() == p.numel() and k != "step"
                                          else v) for k, v in states[name].items()}
        if self.mixed:
            fp32 = [masters.get(self._first_name[id(p)], m).view_as(m)
                    for b in self.buckets for p, m in zip(b.params, b.masters)]
        else:  # the module's fp32 weights are the masters: take them from the shards
            with torch.no_grad():
                for pg, names in zip(self.optimizer.param_groups, self._group_names):
                    for p, name in zip(pg["params"], names):
                        if name in masters:
                            p.copy_(masters[name].view_as(p))
            fp32 = None
        groups = saved["param_groups"]
        hyper = shards[0].get("param_groups") if shards else None  # the saved lr, betas, ... (ZeRO shards keep them)
        if hyper is not None and len(hyper) == len(groups):
            groups = [{**g, **h, "params": g["params"]} for g, h in zip(groups, hyper)]
        out = {"optimizer": {"state": opt_state, "param_groups": groups}}
        if fp32 is not None:
            out["fp32_masters"] = fp32
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
