"""ZeRO++ for stage 3 (DeepSpeed 0.19.8's `zero_quantized_weights`,
`zero_quantized_nontrainable_weights`, `zero_quantized_gradients`, `zero_hpz_partition_size`):
less traffic between hosts for the same training.

qwZ   The all-gathers of ZeRO-3's forward and backward send each rank's shards as int8 blocks
      with one fp32 scale per block (DeepSpeed's CUDAQuantizer: shards read as fp16, blocks of
      about 8000 elements, `quantize_ref.qwz_groups`), dequantized to fp16 on arrival and cast
      to the parameter's dtype. The shards and the fp32 masters are never quantized: only what
      crosses the wire. Full-value gathers (checkpoints, GatheredParameters) stay exact, as
      DeepSpeed's do.
frozen With zero_quantized_nontrainable_weights, the shards of frozen parameters are kept as
      int8 blocks (`Packed`): a quarter of fp32's memory, and gathered as they are.
hpZ   After a module's forward releases a parameter, this rank keeps a second shard of it, cut
      over the zero_hpz_partition_size ranks of its host (`secondary`); the next gathers of
      that parameter (backward, the forwards of further micro-steps) read those shards over
      that group, so they never leave the host. A step (or anything that writes the
      parameter) drops the second shards, and the next forward gathers from the primary ones
      again. The secondary group must lie inside one host (refused otherwise): that is the point.
qgZ   Each weight's gradient (2-D or more, elements a multiple of twice the world, as DeepSpeed
      requires) is quantized to int4 in DeepSpeed's blocks (max(rows, columns, world) of them),
      its blocks ordered by destination so that one all-to-all inside each host hands every
      local rank the blocks it will own across all hosts; each rank dequantizes what its host
      peers sent, sums it (fp16 for fp16 gradients, as DeepSpeed's kernel, else fp32),
      quantizes the sum to int4 again, and one all-to-all across hosts (the ranks with the same
      place in every host) delivers each rank its partition, which it dequantizes and sums over
      hosts. Gradients that do not qualify (biases, norms, odd sizes) take the plain
      reduce-scatter, as in DeepSpeed. One host: everything takes the plain reduce-scatter
      (DeepSpeed does the same). Differences from DeepSpeed, on purpose: the result is the plain
      sum over ranks, which the engine then averages like any reduce-scatter (DeepSpeed divides
      by the number of hosts only, so its weight gradients come out `ranks per host` times the
      mean while its bias gradients are the mean); a gradient in bf16 or fp32 is quantized in its
      own dtype (DeepSpeed's kernel reads any gradient's bytes as fp16); all of a bucket's
      gradients share one all-to-all per stage (DeepSpeed issues two per gradient).

Hosts come from the launcher (runtime/core/parallel/hosts.py): the data-parallel ranks split into
equal runs of consecutive ranks per host.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..core import comm
from ..core.strict import ConfigError
from dslaunch.kernels import quantize_ref
from dslaunch.kernels.quantizer import dequantize, quantize

QWZ_BITS = 8
QGZ_BITS = 4


@dataclass(frozen=True)
class ZeroPPSettings:
    quantize_weights: bool = False
    quantize_frozen: bool = False
    quantize_gradients: bool = False
    hpz: int = 1  # ranks of the secondary partition group (1: off)

    @classmethod
    def from_config(cls, z) -> "ZeroPPSettings":
        return cls(bool(z.zero_quantized_weights), bool(z.zero_quantized_nontrainable_weights),
                   bool(z.zero_quantized_gradients), max(int(z.zero_hpz_partition_size), 1))

    @property
    def any(self) -> bool:
        return self.quantize_weights or self.quantize_frozen or self.quantize_gradients or self.hpz > 1


# -- quantized storage and transfer ---------------------------------------------------------

def qwz_layout(n: int) -> Tuple[int, int]:
    """(padded elements, blocks) of an n-element buffer under qwZ: padded to a multiple of 8
    (DeepSpeed's kernel loads 8 fp16 at a time and asserts the multiple; the padding here
    lets any size through) and cut into DeepSpeed's block count."""
    n8 = max(-(-n // quantize_ref.QWZ_ALIGN) * quantize_ref.QWZ_ALIGN, quantize_ref.QWZ_ALIGN)
    return n8, quantize_ref.qwz_groups(n8)


def qwz_quantize(flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """qwZ's bytes of a flat buffer: read as fp16 (as DeepSpeed's CUDAQuantizer converts it),
    padded with zeros, int8 blocks; (q, scales)."""
    n8, groups = qwz_layout(flat.numel())
    h = torch.zeros(n8, dtype=torch.float16, device=flat.device)
    h[:flat.numel()].copy_(flat.reshape(-1))
    return quantize(h, groups, QWZ_BITS)


class CUDAQuantizer:
    """DeepSpeed's qwZ quantizer object (deepspeed.runtime.zero.partition_parameters), for
    scripts that quantize a tensor as qwZ does: `quantize(param, groups=None)` gives int8
    blocks and one fp32 scale per block of the values read as fp16 (DeepSpeed's block count
    when `groups` is None), `dequantize(q, scale, dtype=None)` the values back, in `dtype`
    (fp16 when None). The blocks are computed by dslaunch's quantizer op (kernels/quantizer.py,
    the CPU or CUDA build of the tensor's device); a script that sets the class attribute
    `quantizer_cuda_module` to an op object with DeepSpeed's interface (quantize(x, groups,
    bits, kind), dequantize(q, scale, groups, bits, kind), Symmetric) gets that op instead."""

    quantizer_cuda_module = None

    def quantize(self, param: torch.Tensor, groups: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if groups is None:
            groups = quantize_ref.qwz_groups(param.numel())
        # read as fp16 (DeepSpeed's kernel reads __half): a bf16 value is converted, not reinterpreted
        half = param.detach().reshape(-1).to(torch.float16)
        op = self.quantizer_cuda_module
        if op is not None:
            return op.quantize(half, groups, QWZ_BITS, op.Symmetric)
        return quantize(half, groups, QWZ_BITS)

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        op = self.quantizer_cuda_module
        if op is not None:
            out = op.dequantize(quantized_param, scale, scale.numel(), QWZ_BITS, op.Symmetric)
        else:
            out = dequantize(quantized_param, scale, QWZ_BITS, torch.float16)
        return out if dtype is None else out.to(dtype)


@dataclass
class Packed:
    """A flat tensor kept as qwZ's int8 blocks (frozen shards under zero_quantized_nontrainable_weights)."""

    q: torch.Tensor
    scales: torch.Tensor
    numel: int
    dtype: torch.dtype  # what the values come back as

    @classmethod
    def of(cls, flat: torch.Tensor) -> "Packed":
        q, s = qwz_quantize(flat)
        return cls(q, s, flat.numel(), flat.dtype)

    def values(self, device: Optional[torch.device] = None) -> torch.Tensor:
        q, s = (self.q, self.scales) if device is None else (self.q.to(device), self.scales.to(device))
        return dequantize(q, s, QWZ_BITS, torch.float16)[:self.numel].to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scales.numel()


class _BlocksAllGather:
    """Every rank's int8 blocks and fp32 scales over `group` (`rows` ranks), as two all-gathers
    (DeepSpeed's two), possibly still running (async_op) until `wait`."""

    def __init__(self, q: torch.Tensor, s: torch.Tensor, group, rows: int, label: str, async_op: bool):
        self.rows = rows
        self.q_out = torch.empty(rows * q.numel(), dtype=torch.int8, device=q.device)
        self.s_out = torch.empty(rows * s.numel(), dtype=torch.float32, device=q.device)
        self._keep = (q, s)  # alive until the collectives are done
        self.works = [
            comm.all_gather_into_tensor(self.q_out, q, group=group, label=f"{label} (int8)", async_op=async_op),
            comm.all_gather_into_tensor(self.s_out, s, group=group, label=f"{label} (scales)", async_op=async_op)]

    def wait(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []
        self._keep = None


class QuantizedAllGather(_BlocksAllGather):
    """One qwZ all-gather of equal flat buffers over `group` (`rows` ranks); `values()` is the
    (rows, n) result in `dtype`."""

    def __init__(self, local: torch.Tensor, group, rows: int, dtype: torch.dtype, label: str, async_op: bool):
        self.n, self.dtype = local.numel(), dtype
        super().__init__(*qwz_quantize(local), group, rows, label, async_op)

    def values(self) -> torch.Tensor:
        self.wait()
        # every row was quantized in the same blocks: one dequantization of the whole buffer
        full = dequantize(self.q_out, self.s_out, QWZ_BITS, torch.float16).view(self.rows, -1)
        return full[:, :self.n].to(self.dtype)


class PackedAllGather(_BlocksAllGather):
    """All-gather of `Packed` shards as they are (frozen weights): each rank's bytes are the
    concatenation of its shards' blocks, each shard dequantized in its own blocks on arrival."""

    def __init__(self, packs: Sequence[Packed], group, rows: int, device: torch.device, label: str, async_op: bool):
        self.packs = list(packs)
        super().__init__(torch.cat([p.q.to(device) for p in packs]), torch.cat([p.scales.to(device) for p in packs]),
                         group, rows, label, async_op)

    def rows_of(self, i: int) -> List[torch.Tensor]:
        """Pack i's values from every rank, in rank order."""
        self.wait()
        qs, ss = self.q_out.view(self.rows, -1), self.s_out.view(self.rows, -1)
        qo = sum(p.q.numel() for p in self.packs[:i])
        so = sum(p.scales.numel() for p in self.packs[:i])
        p = self.packs[i]
        return [Packed(qs[r, qo:qo + p.q.numel()], ss[r, so:so + p.scales.numel()], p.numel, p.dtype).values()
                for r in range(self.rows)]


# -- qgZ ---------------------------------------------------------------------------------------

def qgz_blocks(shape: Sequence[int], world: int) -> Optional[int]:
    """DeepSpeed's int4 block count for a gradient of `shape` over `world` ranks,
    max(rows, columns, world), or None when the gradient takes the plain reduce-scatter:
    DeepSpeed's conditions (2-D or more, elements a multiple of 2 x world) and the ones its
    kernels assume without checking (whole blocks per destination rank, an even block size)."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0 or numel % (2 * world):
        return None
    groups = max(int(shape[0]), int(shape[1]), world)
    if numel % groups or groups % world or (numel // groups) % 2:
        return None
    return groups


def _swizzle(x: torch.Tensor, hosts: int, local: int) -> torch.Tensor:
    """Rows of x (one per destination rank n*local + d) reordered to d*hosts + n, DeepSpeed's
    swizzled layout: the rows for local rank d of every host become contiguous."""
    order = [n * local + d for d in range(local) for n in range(hosts)]
    return x.view(hosts * local, -1)[order]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8).reshape(-1)


class QuantizedReduceScatter:
    """qgZ for the gradients of one bucket (see the module docstring): the data-parallel
    group as `hosts` x `local` ranks, rank = host * local + place."""

    def __init__(self, host_group, cross_group, hosts: int, local: int):
        self.host_group, self.cross_group = host_group, cross_group
        self.hosts, self.local = hosts, local

    def __call__(self, grads: List[torch.Tensor], blocks: List[int], label: str) -> List[torch.Tensor]:
        """grads: full flat gradients (fp16/bf16/fp32, as the engine hands them to the
        collective); returns this rank's partition of each, summed over every rank, in the
        working dtype (fp16 for fp16 gradients, else fp32)."""
        hosts, local = self.hosts, self.local
        world = hosts * local
        work = [torch.float16 if g.dtype == torch.float16 else torch.float32 for g in grads]
        # stage 1: int4 blocks ordered by destination, one all-to-all inside the host
        sends: List[List[torch.Tensor]] = [[] for _ in range(local)]
        scale_sends: List[List[torch.Tensor]] = [[] for _ in range(local)]
        for g, b in zip(grads, blocks):
            q, s = quantize(g, b, QGZ_BITS)
            q, s = _swizzle(q, hosts, local), _swizzle(s, hosts, local)
            for d in range(local):
                sends[d].append(q[d * hosts:(d + 1) * hosts].reshape(-1))
                scale_sends[d].append(_as_bytes(s[d * hosts:(d + 1) * hosts]))
        got = self._exchange(sends, scale_sends, self.host_group, local, f"{label} (inside the host)")
        # stage 2: dequantize what the host's ranks sent, sum, quantize again
        reduced_q: List[torch.Tensor] = []
        reduced_s: List[torch.Tensor] = []
        for i, (g, b) in enumerate(zip(grads, blocks)):
            acc = None
            for j in range(local):
                part = dequantize(got[j][0][i], got[j][1][i], QGZ_BITS, work[i])
                acc = torch.zeros_like(part) + part if acc is None else acc + part
            q2, s2 = quantize(acc, b // local, QGZ_BITS)
            reduced_q.append(q2.view(hosts, -1))
            reduced_s.append(s2.view(hosts, -1))
        # stage 3: one all-to-all across hosts; each rank sums its partition over hosts
        sends = [[reduced_q[i][n].reshape(-1) for i in range(len(grads))] for n in range(hosts)]
        scale_sends = [[_as_bytes(reduced_s[i][n]) for i in range(len(grads))] for n in range(hosts)]
        got = self._exchange(sends, scale_sends, self.cross_group, hosts, f"{label} (across hosts)")
        out = []
        for i in range(len(grads)):
            total = None
            for m in range(hosts):
                part = dequantize(got[m][0][i], got[m][1][i], QGZ_BITS, work[i])
                total = torch.zeros_like(part) + part if total is None else total + part
            out.append(total)
        return out

    @staticmethod
    def _exchange(sends, scale_sends, group, peers: int, label: str):
        """One even all-to-all of int8 bytes: peer k gets sends[k] then scale_sends[k]
        (concatenated); returns, per source peer, (its q blocks, its fp32 scales) per gradient."""
        sizes = [[t.numel() for t in sends[0]], [t.numel() for t in scale_sends[0]]]
        rows = [torch.cat(sends[k] + scale_sends[k]) for k in range(peers)]
        inp = torch.cat(rows)
        out = torch.empty_like(inp)
        if peers > 1:
            comm.all_to_all_single(out, inp, group=group, label=label)
        else:
            out.copy_(inp)
        per = rows[0].numel()
        got = []
        for k in range(peers):
            row = out[k * per:(k + 1) * per]
            qs = list(torch.split(row[:sum(sizes[0])], sizes[0]))
            ss = [t.view(torch.float32) for t in torch.split(row[sum(sizes[0]):], sizes[1])]
            got.append((qs, ss))
        return got


# -- the engine's ZeRO++ state -------------------------------------------------------------------

class ZeroPP:
    """What ZeRO++ adds to one ZeRO-3 engine: the host split of the data-parallel group, the
    hpZ and qgZ groups, and the settings. Collective: every data-parallel rank builds it."""

    def __init__(self, settings: ZeroPPSettings, group, world: int, rank: int, new_group):
        from ..core.parallel.hosts import discover

        self.settings = settings
        self.world, self.rank = world, rank
        ranks = comm.get_all_ranks_from_group(group)
        self.split = discover(group, ranks) if world > 1 else None
        self.hpz_group, self.hpz, self.hpz_rank = None, 1, 0
        self.qgz: Optional[QuantizedReduceScatter] = None
        if min(settings.hpz, world) > 1:  # DeepSpeed caps the size at the world (one rank: hpZ is off)
            self._make_hpz(ranks, new_group)
        if settings.quantize_gradients and self.split is not None and self.split.n_hosts > 1:
            self._make_qgz(ranks, new_group)
        elif settings.quantize_gradients and comm.get_rank() == 0:
            print("dslaunch: ZeRO++ qgZ: the data-parallel ranks are on one host, so gradients take the plain "
                  "reduce-scatter (as in DeepSpeed)", file=sys.stderr, flush=True)

    def _make_hpz(self, ranks: List[int], new_group) -> None:
        size = min(self.settings.hpz, self.world)
        key = "zero_optimization.zero_hpz_partition_size"
        if self.world % size:
            raise ConfigError(f"{key}={self.settings.hpz}: does not divide the {self.world} data-parallel ranks")
        lists = [ranks[i:i + size] for i in range(0, len(ranks), size)]
        for block in lists:
            on = sorted({self.split.host_of(r) for r in block}) if self.split is not None else []
            if len(on) > 1:
                per = max(len(b) for b in self.split.per_host())
                raise ConfigError(f"{key}={self.settings.hpz}: ranks {block[0]}-{block[-1]} span hosts "
                                  f"{', '.join(on)}; hpZ's second partition must stay inside one host (at most {per} "
                                  "ranks here)")
        me = comm.get_rank()
        for block in lists:  # every rank creates every group, in the same order
            g = new_group(block, name="hpZ " + ",".join(map(str, block)))
            if me in block:
                self.hpz_group, self.hpz_rank = g, block.index(me)
        self.hpz = size

    def _make_qgz(self, ranks: List[int], new_group) -> None:
        problem = self.split.problem()
        if problem:
            raise ConfigError(f"zero_optimization.zero_quantized_gradients: qgZ reduces inside each host, then "
                              f"across hosts, but {problem}")
        me = comm.get_rank()
        mine = {}
        for kind, lists in (("host", self.split.local_lists()), ("cross-host", self.split.cross_lists())):
            for block in lists:
                g = new_group(block, name=f"qgZ {kind} " + ",".join(map(str, block)))
                if me in block:
                    mine[kind] = (g, block)
        self.qgz = QuantizedReduceScatter(mine["host"][0], mine["cross-host"][0], self.split.n_hosts,
                                          self.split.local_size)

    # -- hpZ second shards ------------------------------------------------------------------
    def secondary_width(self, chunk: int) -> int:
        """Elements of one second shard of a parameter whose primary shard has `chunk`."""
        return chunk * (self.world // self.hpz)

    def keep_secondary(self, p) -> None:
        """Cut this rank's second shard from p's whole value (before it is released)."""
        z = p._zero
        width = self.secondary_width(z.chunk)
        start = self.hpz_rank * width
        flat = p.data.reshape(-1)
        sec = torch.zeros(width, dtype=p.dtype, device=z.shard_device)
        take = max(0, min(z.numel - start, width))
        if take:
            sec[:take].copy_(flat[start:start + take])
        z.secondary = Packed.of(sec) if z.packed is not None else sec


def qgz_eligible(params, world: int) -> Tuple[List, List]:
    """(params whose gradients go through qgZ, the others with why), by shape."""
    yes, no = [], []
    for p in params:
        (yes if qgz_blocks(p._zero.shape, world) is not None else no).append(p)
    return yes, no
