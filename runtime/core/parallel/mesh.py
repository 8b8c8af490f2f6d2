"""The process mesh: this rank's place on every named axis, and the process group of each.

    mesh = ProcessMesh(topology_for(MeshDims.for_world(8, pipe=2, tensor=2)))  # collective
    mesh.size("tensor"), mesh.rank("data"), mesh.group("pipe"), mesh.ranks("data")

Axes (DeepSpeed's rank order: tensor fastest, then sequence, data, pipe):

    pipe         one pipeline (same replica and slice): activations, the loss broadcast
    data         same stage, sequence and tensor slice, every replica: gradients, ZeRO shards
    sequence     the ranks sharing one sequence (Ulysses all-to-alls)
    tensor       Megatron-style tensor slices (DeepSpeed's topology calls the axis `model`)
    data_sequence  data x sequence: where replicated parameters' gradients are averaged
                 when a sequence is split (equal to `data` without sequence parallelism)
    expert       expert-parallel groups: `expert` consecutive members of a data group
    expert_data  the replicas of one expert: where expert parameters' gradients reduce
    replica      every rank of one data replica (pipe x sequence x tensor), DeepSpeed's
                 "model parallel" group: a global gradient norm or overflow flag sums over it
    world        every rank

Every group is created at construction, in one fixed order, by every rank (process-group
creation is collective); asking for an axis only looks it up. Nothing is ever the world
unless the axis really spans the world. `group_factory=` builds a mesh without processes
(tests); by default groups come from `new_group` below, named after their axis and ranks for
flight records and comms logs, and destroyed by the runtime's exit handler.

`PipelineParallelGrid` is the same mesh seen through DeepSpeed's getters (one per axis), for
the pipeline engine and for scripts written against DeepSpeed's topology module.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import comm
from ..comm import shutdown
from .dims import MeshDims, MeshError
from .layout import (GroupFactory, PipeDataParallelTopology, ProcessTopology, default_topology, expert_comm_lists)

AXES = ("pipe", "data", "sequence", "tensor", "data_sequence", "expert", "expert_data", "replica", "world")
# the mesh's name -> the topology's (DeepSpeed's) name
_TOPOLOGY_AXIS = {"tensor": "model"}


def new_group(ranks: Sequence[int], name: Optional[str] = None):
    """A process group over `ranks` (global ranks), named `name` in flight records and comms
    logs. Every rank of the job must call this with the same lists in the same order, except
    for one-rank groups, which only their member creates. The whole world is the existing
    default group, not a copy. Groups are made by dslaunch.runtime.comm, which destroys them
    at exit."""
    import torch.distributed as dist

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


def current_rank_and_world() -> Tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise MeshError("the process mesh needs torch.distributed initialised first "
                        "(call deepspeed.init_distributed())")
    return dist.get_rank(), dist.get_world_size()


class ProcessMesh:
    """This rank's coordinates on a topology, and one process group per named axis.

    Collective: every rank must construct it. `rank`, `world_size` and `group_factory`
    exist so tests can build meshes without processes; by default they come from
    torch.distributed. `expert` splits the data axis into expert-parallel groups."""

    def __init__(self, topology: Optional[ProcessTopology] = None, *, expert: int = 1,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 group_factory: Optional[GroupFactory] = None):
        if rank is None or world_size is None:
            rank, world_size = current_rank_and_world()
        self.global_rank, self.world_size = int(rank), int(world_size)
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise MeshError(f"topology {self._topo} has {self._topo.world_size()} ranks but the job has "
                            f"{self.world_size}")
        self._factory = group_factory  # None: new_group above (named, destroyed at exit)
        self._groups: Dict[Tuple[int, ...], Any] = {}
        if group_factory is None:
            # This dict holds only pybind objects, so the garbage collector does not track
            # it and the exit handler cannot find the groups in it: drop them explicitly.
            shutdown.register_owner(self._release_groups)
        self.dims = MeshDims(pipe=self._dim("pipe"), data=self._dim("data"), sequence=self._dim("sequence"),
                             tensor=self._dim("tensor"), expert=1)
        lists = self._comm_lists()
        if expert > 1:
            lists["expert"], lists["expert_data"] = expert_comm_lists(lists["data"], expert)
            self.dims = MeshDims(pipe=self.dims.pipe, data=self.dims.data, sequence=self.dims.sequence,
                                 tensor=self.dims.tensor, expert=expert)
        self._lists = lists
        # this rank's member list and group per axis; created in AXES order on every rank
        self._mine: Dict[str, List[int]] = {}
        self._group: Dict[str, Any] = {}
        for axis in ("replica", "data", "pipe", "tensor", "sequence", "data_sequence", "expert", "expert_data"):
            self._group[axis], self._mine[axis] = self._make_groups(axis, lists[axis])
        self._mine["world"] = list(range(self.world_size))
        self._group["world"] = self._world_group()

    # -- construction -------------------------------------------------------------------
    def _dim(self, axis: str) -> int:
        return max(self._topo.get_dim(_TOPOLOGY_AXIS.get(axis, axis)), 1)

    def _axis_lists(self, axis: str) -> List[List[int]]:
        # an axis the topology lacks has size 1: every rank is its own group
        name = _TOPOLOGY_AXIS.get(axis, axis)
        return self._topo.get_axis_comm_lists(name) or [[r] for r in range(self.world_size)]

    def _free_of(self, fixed: Sequence[str]) -> List[List[int]]:
        """Groups of the ranks that share their coordinates on the `fixed` axes."""
        fixed = [a for a in fixed if a in self._topo.axes]
        buckets: Dict[Tuple[int, ...], List[int]] = {}
        for r in range(self.world_size):
            c = self._topo.get_coord(r)
            buckets.setdefault(tuple(getattr(c, a) for a in fixed), []).append(r)
        return list(buckets.values())

    def _comm_lists(self) -> Dict[str, List[List[int]]]:
        lists = {axis: self._axis_lists(axis) for axis in ("data", "pipe", "tensor", "sequence")}
        # DeepSpeed's model-parallel group: one list per data coordinate (pipe x sequence x model)
        lists["replica"] = [sorted(self._topo.get_axis_list("data", d)) if "data" in self._topo.axes
                            else list(range(self.world_size)) for d in range(self.dims.data)]
        lists["data_sequence"] = (self._free_of(["pipe", "model"]) if self.dims.sequence > 1 else lists["data"])
        lists["expert"] = [[r] for r in range(self.world_size)]
        lists["expert_data"] = lists["data"]
        return lists

    def _release_groups(self) -> None:
        self._groups.clear()
        self._group.clear()

    def _world_group(self):
        return self.new_group(list(range(self.world_size)), name="world")

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

    def _make_groups(self, axis: str, lists: List[List[int]]):
        """Create every group of one axis (same order on every rank); return ours."""
        mine_group, mine = None, None
        for ranks in lists:
            g = self.new_group(ranks, name=f"{axis} " + ",".join(map(str, sorted(ranks))))
            if self.global_rank in ranks:
                mine_group, mine = g, list(ranks)
        return mine_group, mine

    # -- the mesh by axis name -------------------------------------------------------------
    def _check(self, axis: str) -> str:
        if axis not in self._mine:
            raise MeshError(f"mesh axis {axis!r} does not exist (axes: {', '.join(AXES)})")
        return axis

    def group(self, axis: str):
        """The process group of this rank along `axis` (None for a one-rank axis in a mesh
        built without processes)."""
        return self._group.get(self._check(axis))

    def ranks(self, axis: str) -> List[int]:
        """The global ranks of this rank's group along `axis`, in group-rank order."""
        return list(self._mine[self._check(axis)])

    def describes(self, axis: str) -> bool:
        """Whether `axis` is one of this mesh's (every axis of AXES is)."""
        return axis in self._mine

    def size(self, axis: str) -> int:
        return len(self._mine[self._check(axis)])

    def rank(self, axis: str) -> int:
        """This rank's index in its group along `axis`."""
        return self._mine[self._check(axis)].index(self.global_rank)

    def comm_lists(self, axis: str) -> List[List[int]]:
        """Every group along `axis` (not only this rank's)."""
        return [list(x) for x in self._lists[self._check(axis)]] if axis != "world" else [
            list(range(self.world_size))]

    def topology(self) -> ProcessTopology:
        return self._topo

    def coord(self, rank: Optional[int] = None):
        return self._topo.get_coord(self.global_rank if rank is None else rank)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.dims}, rank {self.global_rank})"


class PipelineParallelGrid(ProcessMesh):
    """The mesh through DeepSpeed's getters (DeepSpeed's `PipelineParallelGrid`):

        get_data_parallel_group()      the `data` axis: gradients, ZeRO shards, the loss average
        get_pipe_parallel_group()      the `pipe` axis: the loss broadcast
        get_slice_parallel_group()     the `tensor` axis (= get_tensor_model_parallel_group())
        get_model_parallel_group()     DeepSpeed's meaning: the `replica` axis (pipe x tensor),
                                       equal to the tensor group when there is no pipeline
    """

    def __init__(self, topology: Optional[ProcessTopology] = None, process_group=None, *,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 group_factory: Optional[GroupFactory] = None, expert: int = 1):
        super().__init__(topology, expert=expert, rank=rank, world_size=world_size, group_factory=group_factory)
        self.data_parallel_size = self.dims.data
        self.pipe_parallel_size = self.dims.pipe
        self.model_parallel_size = self.dims.tensor
        self.slice_parallel_size = self.dims.tensor
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.dp_groups = self.comm_lists("data")
        self.pipe_groups = self.comm_lists("pipe")
        self.model_groups = self.comm_lists("tensor")
        self.ds_model_groups = self.comm_lists("replica")
        self.dp_group, self.pp_group, self.slice_group = self.ranks("data"), self.ranks("pipe"), self.ranks("tensor")
        self.ds_model_ranks = self.ranks("replica")
        self.ds_model_rank = self.rank("replica")
        self.ds_model_world_size = self.size("replica")
        self.p2p_groups = self._p2p_pairs()

    # kept as attributes by DeepSpeed's grid; here views of the mesh's groups
    @property
    def dp_proc_group(self):
        return self.group("data")

    @property
    def pp_proc_group(self):
        return self.group("pipe")

    @property
    def slice_proc_group(self):
        return self.group("tensor")

    @property
    def ds_model_proc_group(self):
        return self.group("replica")

    def _p2p_pairs(self) -> List[List[int]]:
        """[rank, its next stage's rank (wrapping)] for every rank."""
        pairs = []
        for rank in range(self.world_size):
            line = next(l for l in self.pipe_groups if rank in l)
            pairs.append([rank, line[(line.index(rank) + 1) % len(line)]])
        return pairs

    # -- DeepSpeed's accessors ---------------------------------------------------------------
    def _is_grid_valid(self) -> bool:
        """DeepSpeed's check that the topology spans the job. Always true of a grid that
        exists: the constructor already refuses a topology of another size, naming both."""
        return self._topo.world_size() == self.world_size

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
            raise MeshError(f"stage {stage_id} does not exist: this topology has no pipe axis")
        me.update(coords)
        return self._topo.get_rank(**me)

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self.group("pipe")

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self.group("data")

    def get_data_parallel_group_ranks(self) -> List[int]:
        return self.ranks("data")

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        return self.group("replica")

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self.group("tensor")

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group

    def get_sequence_parallel_group(self):
        return self.group("sequence")

    def get_sequence_parallel_world_size(self) -> int:
        return self.size("sequence")

    def get_sequence_parallel_rank(self) -> int:
        return self.rank("sequence")


def data_parallel_grid(rank: Optional[int] = None, world_size: Optional[int] = None,
                       group_factory: Optional[GroupFactory] = None) -> PipelineParallelGrid:
    """The mesh of an engine without a pipeline or an mpu: one data axis over the world
    (its data-parallel group is the default group itself; nothing is created)."""
    if rank is None or world_size is None:
        rank, world_size = current_rank_and_world()
    return PipelineParallelGrid(PipeDataParallelTopology(num_pp=1, num_dp=world_size), rank=rank,
                                world_size=world_size, group_factory=group_factory)
