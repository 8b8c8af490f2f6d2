"""Muon under ZeRO (stages 1-3): whole-matrix updates from partitioned gradients.

The momentum and the Nesterov blend are elementwise, so each rank computes them on its own
flat partition of the Muon group, in one op each, with the momentum kept as a partition of
the group's optimizer state exactly as Adam's moments are (between steps a rank holds its
1/N of the momentum and nothing else for the Muon group). Only Newton-Schulz needs a whole
matrix; how it gets one depends on the layout:

- stages 1-2 (`flat_layout_updates`): the group is one flat buffer cut into contiguous
  partitions, so most matrices lie whole in one rank's partition and are orthogonalised
  there without any communication. A matrix that crosses a partition boundary is gathered
  (each owner adds its pieces of the blend into a zero buffer, one all-reduce over the
  group's axis for all such matrices) and orthogonalised by each rank that owns a piece;
  each keeps its own piece of the result.
- stage 3 (`chunked_updates`): every parameter is chunked over every rank, so the blend is
  all-gathered (one collective for the group), each matrix is orthogonalised by one rank
  (matrices dealt out by cost, so the ranks share the work), and a reduce-scatter returns
  to each rank its chunk of every result.

Either way each rank's matrices go through Newton-Schulz one batch per shape, and the
gradient partition is overwritten with the update. As in DeepSpeed's stages 1-3 this happens
before the global norm, so gradient clipping measures and scales the orthogonalised update
(stage 0 clips the raw gradient; DeepSpeed's other clip-first path, stage 1 in bf16 with
fp32 accumulation, is refused here for every optimizer). The gradient then still carries
the fp16 loss scale: it is divided out before the momentum (which then holds true gradients
whatever the scale does) and multiplied back into the update, so the engine's unscale
leaves the update itself.

The new momentum is staged and committed at the step, so a step skipped for an overflow
leaves it as it was (`commit` / `discard`).

Checkpoints at stages 1-2 carry the momentum in DeepSpeed's layout, the whole of every matrix a
rank's partition touches (`whole_momenta`): the crossing matrices are gathered for the save
only, so between steps a rank still holds just its partition.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .. import comm
from ..strict import ConfigError
from . import newton_schulz as ns

MOMENTUM = "momentum_buffer"


def check_in_memory_flag(config, optimizer) -> None:
    """`save_muon_momentum_buffer_in_memory: true` does something only where Muon's momentum
    would otherwise go to NVMe files: refuse it elsewhere rather than ignore it."""
    z = config.zero_optimization
    if not z.save_muon_momentum_buffer_in_memory:
        return
    if not ShardedMuon.applies(optimizer) or z.offload_optimizer_device != "nvme" or z.stage == 0:
        raise ConfigError("zero_optimization.save_muon_momentum_buffer_in_memory: true keeps Muon's momentum out of "
                          "offload_optimizer's NVMe files, so it needs \"optimizer\": {\"type\": \"Muon\"}, ZeRO "
                          "stage 1-3 and offload_optimizer.device \"nvme\"; remove it")


def resident_keys(config) -> Tuple[str, ...]:
    """The optimizer state an NVMe host keeps in memory (check_in_memory_flag vetted the flag)."""
    return (MOMENTUM,) if config.zero_optimization.save_muon_momentum_buffer_in_memory else ()


class ShardedMuon:
    """The momentum side of one ZeRO strategy's Muon groups."""

    def __init__(self, optimizer, host, loss_scale: Callable[[], float]):
        self.optimizer, self.host = optimizer, host
        self.loss_scale = loss_scale
        optimizer.updates_given = True
        self.staged: Dict[int, torch.Tensor] = {}

    @staticmethod
    def applies(optimizer) -> bool:
        return optimizer is not None and any(g.get("use_muon", False) for g in optimizer.param_groups) and \
            hasattr(optimizer, "updates_given")

    def groups(self) -> List[int]:
        return [gi for gi, g in enumerate(self.optimizer.param_groups) if g.get("use_muon", False)]

    def settings(self, gi: int) -> Tuple[float, str]:
        g = self.optimizer.param_groups[gi]
        return g["momentum"], g["ns_method"]

    def _momentum(self, gi: int, master: torch.Tensor) -> torch.Tensor:
        """The committed momentum of group gi (zeros at first), with the step count the
        offload hosts keep beside it (a stage-0 checkpoint's Muon state has none)."""
        state = self.host.state_of(gi)
        if MOMENTUM not in state or "step" not in state:
            state = {"step": torch.zeros((), dtype=torch.float32), **state}
            state.setdefault(MOMENTUM, torch.zeros_like(master))
            self.host.load_state_of(gi, state)
            state = self.host.state_of(gi)
        return state[MOMENTUM]

    def scale(self) -> float:
        return float(self.loss_scale())

    def blend(self, gi: int, master: torch.Tensor, grad: torch.Tensor, scale: float) -> torch.Tensor:
        """The Nesterov blend of this rank's partition; stages the new momentum."""
        beta, _ = self.settings(gi)
        momentum = self._momentum(gi, master)
        g = grad.to(momentum.dtype)
        if scale != 1.0:
            g = g / scale
        staged = torch.lerp(momentum, g.to(momentum.device), 1 - beta)
        self.staged[gi] = staged
        return torch.lerp(g.to(staged.device), staged, beta)

    def commit(self) -> None:
        for gi, staged in self.staged.items():
            state = self.host.state_of(gi)
            state[MOMENTUM].copy_(staged)
            self.host.write_state_of(gi, state)
        self.staged.clear()

    def discard(self) -> None:
        self.staged.clear()


def flat_layout_updates(muon: ShardedMuon, gi: int, grad: torch.Tensor, master: torch.Tensor, layout, pieces,
                        axis, communicates: bool) -> None:
    """Stages 1-2: overwrite `grad` (this rank's partition of group gi) with its Muon update."""
    scale = muon.scale()
    blend = muon.blend(gi, master, grad, scale)
    _, method = muon.settings(gi)
    mine = _by_name(pieces)
    whole = _gather_crossing(blend, layout, mine, axis, f"muon: {{}} matrices across partitions (group {gi})") \
        if communicates else {}
    names, mats, shapes = [], [], []
    for s in layout.slots:
        here = mine.get(s.name)
        if not here:
            continue
        if s.name in whole:
            mats.append(whole[s.name])
        else:  # wholly in this partition (or a world of one)
            piece = here[0]
            mats.append(blend[piece.offset:piece.offset + s.numel])
        names.append(s)
    updates = ns.orthogonalize(mats, [s.shape for s in names], method, torch.float32)
    for s, update in zip(names, updates):
        if scale != 1.0:
            update = update * scale
        for piece in mine[s.name]:
            grad[piece.offset:piece.offset + piece.numel].copy_(update[piece.start:piece.end])


def _by_name(pieces) -> Dict[str, List]:
    mine: Dict[str, List] = {}
    for piece in pieces:
        mine.setdefault(piece.name, []).append(piece)
    return mine


def _crossing(layout) -> List:
    """The slots whose first and last elements have different owners."""
    size = layout.partition_size
    return [s for s in layout.slots if s.numel and s.offset // size != (s.offset + s.numel - 1) // size]


def _gather_crossing(part: torch.Tensor, layout, mine: Dict[str, List], axis, label: str, device=None
                     ) -> Dict[str, torch.Tensor]:
    """Every matrix crossing a partition boundary, whole on every rank of the axis: each owner
    adds its pieces of `part` into one zero buffer (on `device`, the communication device;
    `part`'s by default), summed by one all-reduce ({} in `label` takes the count)."""
    crossing = _crossing(layout)
    if not crossing:
        return {}
    starts, total = {}, 0
    for s in crossing:
        starts[s.name] = total
        total += s.numel
    buf = torch.zeros(total, dtype=part.dtype, device=part.device if device is None else device)
    for s in crossing:
        for piece in mine.get(s.name, ()):
            at = starts[s.name]
            buf[at + piece.start:at + piece.end] = part[piece.offset:piece.offset + piece.numel].to(buf.device)
    comm.all_reduce(buf, group=axis.group, label=label.format(len(crossing)))
    return {s.name: buf[starts[s.name]:starts[s.name] + s.numel] for s in crossing}


def whole_momenta(momentum: torch.Tensor, layout, pieces, axis, communicates: bool, device=None
                  ) -> Dict[str, torch.Tensor]:
    """Stages 1-2, for a checkpoint: the whole momentum of every matrix this rank's partition
    touches, in layout order, flattened. That is what DeepSpeed 0.19.8 keeps (and saves and
    loads) per rank, where a rank here keeps only its own elements between steps: the
    matrices crossing a boundary are gathered now, for the save only (one all-reduce over the
    group's axis on `device`; every rank of it takes part). The results are on the momentum's device."""
    mine = _by_name(pieces)
    whole = _gather_crossing(momentum, layout, mine, axis, "muon: {} momenta across partitions (checkpoint)",
                             device) if communicates else {}
    out: Dict[str, torch.Tensor] = {}
    for s in layout.slots:
        here = mine.get(s.name)
        if not here:
            continue
        if s.name in whole:
            out[s.name] = whole[s.name].to(momentum.device, copy=True)
        elif here[0].numel == s.numel:
            out[s.name] = momentum[here[0].offset:here[0].offset + s.numel].clone()
        else:
            raise ValueError(f"muon: {s.name} crosses a partition boundary but the group does not communicate")
    return out


def deal(costs: Sequence[float], ranks: int) -> List[int]:
    """Each item's rank: largest first onto the least loaded rank (ties to the lowest rank),
    the same on every rank."""
    load = [0.0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def ns_cost(shape: Sequence[int]) -> float:
    rows, cols = ns.matrix_view_shape(shape)[-2:]
    batch = math.prod(ns.matrix_view_shape(shape)[:-2]) if len(shape) > 2 else 1
    return float(batch) * rows * cols * min(rows, cols)


def chunked_updates(muon: ShardedMuon, gi: int, grad: torch.Tensor, master: torch.Tensor,
                    params: Sequence[Tuple[str, Tuple[int, ...], int, int, int]], world: int, rank: int, group,
                    communicates: bool) -> None:
    """Stage 3: `params` are (name, shape, numel, offset of its chunk in the partition, chunk
    length); rank r's chunk of a parameter is elements [r * chunk, (r + 1) * chunk)."""
    scale = muon.scale()
    blend = muon.blend(gi, master, grad, scale)
    _, method = muon.settings(gi)
    if communicates and world > 1:
        rows = torch.empty(world * blend.numel(), dtype=blend.dtype, device=blend.device)
        comm.all_gather_into_tensor(rows, blend.contiguous(), group=group,
                                    label=f"muon: gather {len(params)} matrices (group {gi})")
        rows = rows.view(world, -1)
        owners = deal([ns_cost(shape) for _, shape, _, _, _ in params], world)
    else:
        rows, owners, world = blend.view(1, -1), [0] * len(params), 1
    mine = [i for i, r in enumerate(owners) if r == rank or world == 1]
    mats = [rows[:, params[i][3]:params[i][3] + params[i][4]].reshape(-1)[:params[i][2]] for i in mine]
    updates = ns.orthogonalize(mats, [params[i][1] for i in mine], method, torch.float32)
    if world == 1:
        for i, update in zip(mine, updates):
            _, _, numel, offset, _ = params[i]
            grad[offset:offset + numel].copy_(update * scale if scale != 1.0 else update)
        return
    out = torch.zeros(world, blend.numel(), dtype=blend.dtype, device=blend.device)
    for i, update in zip(mine, updates):
        _, _, numel, offset, chunk = params[i]
        padded = torch.zeros(world * chunk, dtype=update.dtype, device=update.device)
        padded[:numel] = update
        out[:, offset:offset + chunk] = padded.view(world, chunk)
    result = torch.empty_like(blend)
    comm.reduce_scatter_tensor(result, out.view(-1), group=group,
                               label=f"muon: scatter {len(params)} updates (group {gi})")
    grad.copy_(result * scale if scale != 1.0 else result)
