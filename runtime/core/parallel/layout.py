"""The rank layout: which rank holds which pipeline stage, data replica, sequence and tensor slice.

Pure (no torch.distributed). DeepSpeed's names and axis order, so a rank lands on the same
coordinates as under DeepSpeed (`tests/fixtures/deepspeed_topology.json` is checked against it):

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)   # axes (pipe, data, model)
    topo.get_coord(3)                     # ProcessCoord(pipe=1, data=1, model=0)
    topo.get_axis_comm_lists("data")      # [[0, 1], [2, 3]]: the ranks that reduce gradients together

Layout is row-major over the axes: the last axis varies fastest, so with (pipe, data,
model) the tensor-parallel ranks of one stage are adjacent (same node), then the data
replicas, and pipeline stages are furthest apart (they exchange the least traffic).
`topology_for(dims)` lays out a `MeshDims`; a sequence axis, when there is one, sits between
data and model (Ulysses' all-to-alls are the next heaviest traffic after tensor slicing).
The process groups over these lists are made by `mesh.ProcessMesh`.
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any, Callable, List, Sequence, Tuple

from .dims import MeshDims, MeshError

GroupFactory = Callable[[Sequence[int]], Any]


# A topology that cannot describe this job (bad dims, wrong world size, bad coordinate) is
# the same failure as a bad set of degrees: one error type for both.
TopologyError = MeshError


class ProcessTopology:
    """A row-major mapping between n-dimensional coordinates (named axes) and ranks.

    With axes ['x', 'y'], (x, y) and (x, y+1) are adjacent ranks.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims):
            raise TopologyError(f"topology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise TopologyError(f"topology: axis names repeat: {axes}")
        if any(d < 1 for d in dims):
            raise TopologyError(f"topology: every dim must be >= 1, got {dict(zip(axes, dims))}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)
        # strides of the row-major layout: the last axis moves by one rank
        self._strides = [1] * len(dims)
        for i in range(len(dims) - 2, -1, -1):
            self._strides[i] = self._strides[i + 1] * dims[i + 1]
        self.mapping = {self.ProcessCoord(*c): r for r, c in enumerate(product(*[range(d) for d in dims]))}

    # -- coordinates <-> ranks ---------------------------------------------------------
    def get_rank(self, **coord) -> int:
        """The rank at a full coordinate, e.g. get_rank(pipe=1, data=0, model=0)."""
        if set(coord) != set(self.axes):
            raise TopologyError(f"get_rank: give exactly the axes {self.axes} (got {sorted(coord)}); "
                                "use filter_match() for a slice")
        rank = 0
        for axis, stride, dim in zip(self.axes, self._strides, self.dims):
            v = int(coord[axis])
            if not 0 <= v < dim:
                raise TopologyError(f"get_rank: {axis}={v} is outside 0..{dim - 1}")
            rank += v * stride
        return rank

    def get_coord(self, rank: int):
        if not 0 <= rank < self.world_size():
            raise TopologyError(f"rank {rank} is not in this topology of {self.world_size()} ranks")
        return self.ProcessCoord(*[(rank // s) % d for s, d in zip(self._strides, self.dims)])

    def get_axis_names(self) -> List[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """The size of `axis`; 0 for an axis this topology does not have (as DeepSpeed)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-") -> str:
        """e.g. 'model_01' for rank 1 of a (pipe, data, model) topology; used in file names."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in set(omit_axes))

    # -- groups of ranks ------------------------------------------------------------------
    def get_axis_comm_lists(self, axis: str) -> List[List[int]]:
        """One list per combination of the other axes: the ranks that differ only along
        `axis` (the members of one communicator along it). [] for an unknown axis."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for combo in product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, combo))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **criteria) -> List[int]:
        """Ranks whose coordinates equal every given axis value, in rank order."""
        unknown = [a for a in criteria if a not in self.axes]
        if unknown:
            raise TopologyError(f"filter_match: unknown axes {unknown} (axes are {self.axes})")
        return [r for r in range(self.world_size())
                if all(getattr(self.get_coord(r), a) == v for a, v in criteria.items())]

    def get_axis_list(self, axis: str, idx: int) -> List[int]:
        """Ranks whose coordinate along `axis` is `idx`."""
        return self.filter_match(**{axis: idx})

    def __str__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{a}={d}' for a, d in zip(self.axes, self.dims))})"

    __repr__ = __str__


class PipeDataParallelTopology(ProcessTopology):
    """Axes (pipe, data): data parallelism innermost, so gradient reductions stay on the
    fastest links and the thinner pipeline traffic crosses nodes."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes (pipe, data, model), dims [num_pp, num_dp, num_mp] (DeepSpeed's order)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def prime_factors(n: int) -> List[int]:
    """The prime factors of a positive integer, smallest first (12 -> [2, 2, 3]; 1 -> [])."""
    if n <= 0:
        raise ValueError(f"prime factors of {n}: must be a positive integer")
    out, f = [], 2
    while n > 1:
        while n % f:
            f += 1
        n //= f
        out.append(f)
    return out


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's grid when none is given: the prime factors of the world size dealt
    alternately to pipe and data (12 = 2*2*3 -> pipe 6, data 2)."""
    pp, dp = 1, 1
    for i, f in enumerate(prime_factors(world_size)):
        if i % 2 == 0:
            pp *= f
        else:
            dp *= f
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


def topology_for(dims: MeshDims) -> ProcessTopology:
    """The layout of `dims`: DeepSpeed's (pipe, data, model), with a sequence axis between
    data and model when sequence parallelism is on."""
    if dims.sequence > 1:
        return ProcessTopology(axes=["pipe", "data", "sequence", "model"],
                               dims=[dims.pipe, dims.data, dims.sequence, dims.tensor])
    return PipeModelDataParallelTopology(num_pp=dims.pipe, num_mp=dims.tensor, num_dp=dims.data)


def expert_comm_lists(data_lists: List[List[int]], expert: int) -> Tuple[List[List[int]], List[List[int]]]:
    """DeepSpeed's expert groups cut from the data-parallel groups: expert-parallel groups of
    `expert` consecutive members, and expert-data-parallel groups of the members at the same
    place in each (the replicas of one expert)."""
    ep, edp = [], []
    for line in data_lists:
        if len(line) % expert:
            raise MeshError(f"expert {expert} does not divide data {len(line)}")
        ep.extend(line[i:i + expert] for i in range(0, len(line), expert))
        edp.extend(line[i::expert] for i in range(expert))
    return ep, edp
