"""Process topology: which rank holds which pipeline stage, data replica and tensor slice.

DeepSpeed's names and axis order, so a rank lands on the same coordinates as under
DeepSpeed (`tests/fixtures/deepspeed_topology.json` is checked against it):

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)   # axes (pipe, data, model)
    topo.get_coord(3)                     # ProcessCoord(pipe=1, data=1, model=0)
    topo.get_axis_comm_lists("data")      # [[0, 1], [2, 3]]: the ranks that reduce gradients together
    grid = PipelineParallelGrid(topo)     # creates the process groups (collective: every rank calls it)

Layout is row-major over the axes: the last axis varies fastest, so with (pipe, data,
model) the tensor-parallel ranks of one stage are adjacent (same node), then the data
replicas, and pipeline stages are furthest apart (they exchange the least traffic).

Groups a `PipelineParallelGrid` gives (each a real process group; never the world
unless the axis really spans the world):

    get_data_parallel_group()      same stage and tensor slice, every replica: gradients,
                                   ZeRO shards, the loss average. Shard size/rank come from it.
    get_pipe_parallel_group()      one pipeline (same replica and slice): loss broadcast
    get_slice_parallel_group()     the `model` axis alone: Megatron-style tensor parallelism
        (= get_tensor_model_parallel_group())  -- use this one for TP sharding
    get_model_parallel_group()     DeepSpeed's meaning: every rank of one data replica
                                   (pipe x model), the group a global gradient norm or an
                                   overflow flag is summed over. Equal to the slice group
                                   when there is no pipeline (pp=1).

`ProcessTopology` and its subclasses are pure (no torch.distributed); only the grid
creates groups, through `new_group` below (the one place this module talks to the
process-group layer; pass `group_factory=` to build a grid without processes in tests).
`MpuGrid` adapts a Megatron-style `mpu` object passed to `initialize(mpu=...)`, and
`data_parallel_grid()` is the grid of an engine with neither (one axis: data = world).
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

GroupFactory = Callable[[Sequence[int]], Any]


class TopologyError(ValueError):
    """A topology that cannot describe this job (bad dims, wrong world size, bad coordinate)."""


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


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's grid when none is given: the prime factors of the world size dealt
    alternately to pipe and data (12 = 2*2*3 -> pipe 6, data 2)."""
    pp, dp, n, f, i = 1, 1, world_size, 2, 0
    while n > 1:
        while n % f:
            f += 1
        n //= f
        if i % 2 == 0:
            pp *= f
        else:
            dp *= f
        i += 1
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


# -- process groups --------------------------------------------------------------------------
def new_group(ranks: Sequence[int], name: Optional[str] = None):
    """A process group over `ranks` (global ranks), named `name` in flight records and comms
    logs. Every rank of the job must call this with the same lists in the same order, except
    for one-rank groups, which only their member creates. The whole world is the existing
    default group, not a copy. Groups are made by dslaunch.runtime.comm, which destroys them
    at exit."""
    import torch.distributed as dist

    from . import comm
    from .comm import shutdown

    ranks = sorted(int(r) for r in ranks)
    if ranks == list(range(dist.get_world_size())):
        # tracked too: if the script destroys the default group itself, the exit handler
        # still knows this object and drops the references the engine holds to it
        shutdown.track_group(dist.group.WORLD)
        return dist.group.WORLD
    if len(ranks) == 1:
        # a group of one needs no rendezvous with the others
        if ranks[0] != dist.get_rank():
            return None
        return comm.new_group(ranks, use_local_synchronization=True, name=name)
    return comm.new_group(ranks, name=name)


def _current_rank_and_world() -> Tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TopologyError("PipelineParallelGrid needs torch.distributed initialised first "
                            "(call deepspeed.init_distributed())")
    return dist.get_rank(), dist.get_world_size()


class PipelineParallelGrid:
    """This rank's place in a topology, and the process groups along each axis.

    Collective: every rank must construct it (groups are created in one fixed order).
    Accessors carry DeepSpeed's names (see the module docstring for what each group is).
    `rank`, `world_size` and `group_factory` exist so tests can build grids without
    processes; by default they come from torch.distributed.
    """

    def __init__(self, topology: Optional[ProcessTopology] = None, process_group=None, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 group_factory: Optional[GroupFactory] = None):
        if rank is None or world_size is None:
            rank, world_size = _current_rank_and_world()
        self.global_rank, self.world_size = int(rank), int(world_size)
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise TopologyError(f"topology {self._topo} has {self._topo.world_size()} ranks but the job has "
                                f"{self.world_size}")
        self._factory = group_factory  # None: new_group above (named, destroyed at exit)
        self._groups: Dict[Tuple[int, ...], Any] = {}
        if group_factory is None:
            from .comm import shutdown

            # This dict holds only pybind objects, so the garbage collector does not track
            # it and the exit handler cannot find the groups in it: drop them explicitly.
            shutdown.register_owner(self._release_groups)
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(self._topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

        # DeepSpeed's "model parallel" group: every rank of one data replica (pipe x model)
        self.ds_model_groups = [sorted(self._axis_free_ranks("data", dp)) for dp in range(self.data_parallel_size)]
        self.ds_model_proc_group, self.ds_model_ranks = self._make_groups(self.ds_model_groups, "replica")
        self.ds_model_rank = self.ds_model_ranks.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_ranks)
        self.dp_groups = self._axis_lists("data")
        self.dp_proc_group, self.dp_group = self._make_groups(self.dp_groups, "data")
        self.pipe_groups = self._axis_lists("pipe")
        self.pp_proc_group, self.pp_group = self._make_groups(self.pipe_groups, "pipe")
        self.model_groups = self._axis_lists("model")
        self.slice_proc_group, self.slice_group = self._make_groups(self.model_groups, "model")
        self.p2p_groups = self._p2p_pairs()

    # -- construction -----------------------------------------------------------------------
    def _axis_free_ranks(self, axis: str, idx: int) -> List[int]:
        return self._topo.get_axis_list(axis, idx) if axis in self._topo.axes else list(range(self.world_size))

    def _axis_lists(self, axis: str) -> List[List[int]]:
        # an axis the topology lacks has size 1: every rank is its own group
        return self._topo.get_axis_comm_lists(axis) or [[r] for r in range(self.world_size)]

    def _release_groups(self) -> None:
        self._groups.clear()

    def new_group(self, ranks: Sequence[int], name: Optional[str] = None):
        """The process group over `ranks`, made once per distinct set (named `name`, for
        flight records and logs, by the first caller). Collective like torch's new_group
        (every rank calls it in the same order), except that a one-rank group is made only
        by its member (None elsewhere)."""
        key = tuple(sorted(int(r) for r in ranks))
        if len(key) == 1 and key[0] != self.global_rank:
            return None
        if key not in self._groups:
            self._groups[key] = (self._factory(list(key)) if self._factory is not None
                                 else new_group(key, name=name))
        return self._groups[key]

    def _make_groups(self, lists: List[List[int]], axis: str):
        """Create every group of one axis (same order on every rank); return ours."""
        mine_group, mine = None, None
        for ranks in lists:
            g = self.new_group(ranks, name=f"{axis} " + ",".join(map(str, sorted(ranks))))
            if self.global_rank in ranks:
                mine_group, mine = g, list(ranks)
        return mine_group, mine

    def _p2p_pairs(self) -> List[List[int]]:
        """[rank, its next stage's rank (wrapping)] for every rank."""
        pairs = []
        for rank in range(self.world_size):
            line = next(l for l in self.pipe_groups if rank in l)
            pairs.append([rank, line[(line.index(rank) + 1) % len(line)]])
        return pairs

    # -- DeepSpeed's accessors ---------------------------------------------------------------
    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **coords) -> int:
        """The global rank of `stage_id` in this rank's replica/slice (or in the given ones)."""
        me = self._topo.get_coord(self.global_rank)._asdict()
        if "pipe" in me:
            me["pipe"] = stage_id
        elif stage_id != 0:
            raise TopologyError(f"stage {stage_id} does not exist: this topology has no pipe axis")
        me.update(coords)
        return self._topo.get_rank(**me)

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.pp_proc_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.slice_proc_group

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


def data_parallel_grid(rank: Optional[int] = None, world_size: Optional[int] = None,
                       group_factory: Optional[GroupFactory] = None) -> PipelineParallelGrid:
    """The grid of an engine without a pipeline or an mpu: one data axis over the world
    (its data-parallel group is the default group itself; nothing is created)."""
    if rank is None or world_size is None:
        rank, world_size = _current_rank_and_world()
    return PipelineParallelGrid(PipeDataParallelTopology(num_pp=1, num_dp=world_size), rank=rank,
                                world_size=world_size, group_factory=group_factory)


class MpuGrid:
    """A Megatron-style `mpu` (get_model_parallel_rank/world_size/group and
    get_data_parallel_rank/world_size/group; optionally get_pipe_parallel_* ) seen through
    the grid accessors the engine uses. The mpu's own groups are used as they are."""

    REQUIRED = ("get_model_parallel_rank", "get_model_parallel_world_size", "get_model_parallel_group",
                "get_data_parallel_rank", "get_data_parallel_world_size", "get_data_parallel_group")

    def __init__(self, mpu, global_rank: int = 0):
        missing = [m for m in self.REQUIRED if not callable(getattr(mpu, m, None))]
        if missing:
            raise TopologyError(f"initialize(mpu=...): the mpu object lacks {', '.join(missing)}")
        self.mpu = mpu
        self.global_rank = global_rank
        self.data_parallel_size = int(mpu.get_data_parallel_world_size())
        self.data_parallel_id = int(mpu.get_data_parallel_rank())
        self.model_parallel_size = int(mpu.get_model_parallel_world_size())
        self.pipe_parallel_size = self._optional("get_pipe_parallel_world_size", 1)
        self.stage_id = self._optional("get_pipe_parallel_rank", 0)

    def _optional(self, name: str, default: int) -> int:
        fn = getattr(self.mpu, name, None)
        return int(fn()) if callable(fn) else default

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.mpu.get_data_parallel_group()

    def get_model_parallel_rank(self) -> int:
        return int(self.mpu.get_model_parallel_rank())

    def get_model_parallel_world_size(self) -> int:
        return self.model_parallel_size

    def get_model_parallel_group(self):
        return self.mpu.get_model_parallel_group()

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        fn = getattr(self.mpu, "get_pipe_parallel_group", None)
        return fn() if callable(fn) else None

    def get_slice_parallel_rank(self) -> int:
        fn = getattr(self.mpu, "get_slice_parallel_rank", None) or getattr(self.mpu, "get_tensor_model_parallel_rank",
                                                                           None)
        return int(fn()) if callable(fn) else self.get_model_parallel_rank()

    def get_slice_parallel_world_size(self) -> int:
        fn = getattr(self.mpu, "get_slice_parallel_world_size", None) or getattr(
            self.mpu, "get_tensor_model_parallel_world_size", None)
        return int(fn()) if callable(fn) else self.model_parallel_size

    def get_slice_parallel_group(self):
        fn = getattr(self.mpu, "get_slice_parallel_group", None) or getattr(self.mpu, "get_tensor_model_parallel_group",
                                                                            None)
        return fn() if callable(fn) else self.get_model_parallel_group()
