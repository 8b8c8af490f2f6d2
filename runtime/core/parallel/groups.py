"""`deepspeed.utils.groups`: DeepSpeed's process-group getters, answered by the mesh of the
engine built last (runtime.parallel.current). Accelerate and Hugging Face call the private
ones (`_get_sequence_parallel_group()` for Ulysses); scripts call the public ones.

Before any engine exists every size is 1 and every rank 0 (one process's view), and asking
for a group is an error naming what to do, instead of DeepSpeed's world-group guesses;
`_init_tp_mesh_device` builds the (data, tensor) mesh over the world without an engine, for
scripts that run AutoTP by hand.
"""
from __future__ import annotations

from typing import List

from .. import comm
from .current import current, set_current
from .dims import MeshDims
from .layout import topology_for
from .mesh import ProcessMesh


class GroupsError(RuntimeError):
    pass


def _mesh(what: str):
    mesh = current()
    if mesh is None:
        raise GroupsError(f"deepspeed.utils.groups.{what}: no engine has been built yet; call "
                          "deepspeed.initialize() first (its mesh answers)")
    return mesh


def _size(axis: str) -> int:
    mesh = current()
    return 1 if mesh is None else mesh.size(axis)


def _rank(axis: str) -> int:
    mesh = current()
    return 0 if mesh is None else mesh.rank(axis)


def _expert(name, what: str) -> None:
    """DeepSpeed names expert groups "ep_size_N"; the mesh has one expert degree."""
    if name is None:
        return
    size = _size("expert")
    if str(name) != f"ep_size_{size}":
        raise GroupsError(f"deepspeed.utils.groups.{what}({name!r}): this engine's expert groups are "
                          f"'ep_size_{size}'")


# -- data, model (tensor) and pipeline parallelism ------------------------------------------
def _get_data_parallel_group():
    return _mesh("_get_data_parallel_group").group("data")


def _get_data_parallel_world_size() -> int:
    return _size("data")


def _get_data_parallel_rank() -> int:
    return _rank("data")


def _get_model_parallel_group():
    return _mesh("_get_model_parallel_group").group("tensor")


def _get_model_parallel_world_size() -> int:
    return _size("tensor")


def _get_model_parallel_rank() -> int:
    return _rank("tensor")


def _get_pipeline_parallel_world_size() -> int:
    return _size("pipe")


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
get_model_parallel_group = get_tensor_model_parallel_group = _get_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size = _get_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank = _get_model_parallel_rank
bwc_tensor_model_parallel_world_size = _get_model_parallel_world_size
bwc_pipeline_parallel_world_size = _get_pipeline_parallel_world_size


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size=None) -> None:
    """DeepSpeed's tensor-parallel groups without an engine: the world as data x tensor, tensor
    ranks adjacent (DeepSpeed's order), made the mesh the getters answer from. As in DeepSpeed,
    a mesh that already has tensor-parallel groups is kept. Collective: every rank calls it."""
    mesh = current()
    if mesh is not None and mesh.size("tensor") > 1:
        return
    tp = int(tensor_model_parallel_size)
    world = comm.get_world_size()
    if tp < 1 or world % tp:
        raise GroupsError(f"deepspeed.utils.groups._init_tp_mesh_device: tensor_model_parallel_size {tp} does not "
                          f"divide the world size {world}")
    dp = world // tp if data_parallel_size is None else int(data_parallel_size)
    if dp * tp != world:
        raise GroupsError(f"deepspeed.utils.groups._init_tp_mesh_device: data_parallel_size {dp} x "
                          f"tensor_model_parallel_size {tp} is not the world size {world}")
    set_current(ProcessMesh(topology_for(MeshDims(data=dp, tensor=tp))))


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first member of this rank's tensor-parallel group."""
    mesh = current()
    return 0 if mesh is None else mesh.ranks("tensor")[0]


# -- sequence parallelism (Ulysses) ---------------------------------------------------------
def _get_sequence_parallel_group():
    return _mesh("_get_sequence_parallel_group").group("sequence")


def _get_sequence_parallel_world_size() -> int:
    return _size("sequence")


def _get_sequence_parallel_rank() -> int:
    return _rank("sequence")


def _get_sequence_data_parallel_group():
    return _mesh("_get_sequence_data_parallel_group").group("data_sequence")


def _get_sequence_data_parallel_world_size() -> int:
    return _size("data_sequence")


def _get_sequence_data_parallel_rank() -> int:
    return _rank("data_sequence")


# -- expert parallelism (MoE) ---------------------------------------------------------------
def _get_expert_parallel_group(group_name=None):
    _expert(group_name, "_get_expert_parallel_group")
    return _mesh("_get_expert_parallel_group").group("expert")


def _get_expert_parallel_world_size(group_name=None) -> int:
    _expert(group_name, "_get_expert_parallel_world_size")
    return _size("expert")


def _get_expert_parallel_rank(group_name=None) -> int:
    _expert(group_name, "_get_expert_parallel_rank")
    return _rank("expert")


def _get_expert_model_parallel_world_size() -> int:
    """DeepSpeed's tensor-parallel degree inside an expert: 1, because experts are never split over
    tensor-parallel ranks here (MoE refuses enable_expert_tensor_parallelism in one line), which is
    DeepSpeed's own answer whenever that option is off."""
    return 1


def _get_expert_data_parallel_group(group_name=None):
    _expert(group_name, "_get_expert_data_parallel_group")
    return _mesh("_get_expert_data_parallel_group").group("expert_data")


def _get_expert_data_parallel_world_size(group_name=None) -> int:
    _expert(group_name, "_get_expert_data_parallel_world_size")
    return _size("expert_data")


def _get_expert_data_parallel_rank(group_name=None) -> int:
    _expert(group_name, "_get_expert_data_parallel_rank")
    return _rank("expert_data")


def _get_max_expert_parallel_group():
    """The group of the largest expert-parallel degree: the mesh has one."""
    return _mesh("_get_max_expert_parallel_group").group("expert")


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size=None, pp_size=None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False, folding_spec=None) -> None:
    """DeepSpeed's expert and expert-data groups without an engine: the world as data ranks split
    into expert groups of `expert_parallel_size_` consecutive ranks (DeepSpeed's order), made the
    mesh the getters answer from. A mesh with these expert groups already is kept. DeepSpeed
    keeps groups of several expert degrees side by side; the mesh has one, so asking for another
    degree once there is one is refused. Collective: every rank calls it."""
    what = "deepspeed.utils.groups._create_expert_and_data_parallel"
    ep = int(expert_parallel_size_)
    if (mp_size or 1) > 1 or folding_spec is not None or use_data_before_expert_parallel_:
        raise GroupsError(f"{what}: only the plain expert x data layout is built without an engine "
                          "(mp_size 1, no folding_spec, use_data_before_expert_parallel_ False); "
                          "configure tensor or sequence parallelism with MoE through deepspeed.initialize")
    mesh = current()
    if mesh is not None:
        if mesh.size("expert") == ep:
            return
        if mesh.size("expert") > 1:
            raise GroupsError(f"{what}({ep}): this job's expert groups are 'ep_size_{mesh.size('expert')}', "
                              "and a mesh has one expert-parallel degree")
    pipe = int(pp_size) if pp_size is not None else (1 if mesh is None else mesh.size("pipe"))
    world = comm.get_world_size()
    if pipe < 1 or world % pipe or (world // pipe) % ep:
        raise GroupsError(f"{what}: expert_parallel_size_ {ep} does not divide the {world // max(pipe, 1)} ranks "
                          f"of a pipeline stage (world {world}, pipeline {pipe})")
    set_current(ProcessMesh(topology_for(MeshDims(pipe=pipe, data=world // pipe)), expert=ep))


def _get_expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                               pipeline_parallel_size_: int = 1, use_data_before_expert_parallel_: bool = False):
    """DeepSpeed's layout of the expert and expert-data groups, as rank lists (pure): expert
    groups of `expert_parallel_size_` consecutive data ranks, expert-data groups across them."""
    if use_data_before_expert_parallel_:
        raise GroupsError("_get_expert_parallel_ranks: use_data_before_expert_parallel_ is not supported")
    per_stage = world_size // pipeline_parallel_size_
    dp = per_stage // tensor_parallel_size_
    if expert_parallel_size_ < 1 or dp % expert_parallel_size_:
        raise GroupsError(f"expert parallel size {expert_parallel_size_} does not divide data parallel size {dp}")
    expert_groups: List[List[int]] = []
    expert_data_groups: List[List[int]] = []
    for stage in range(pipeline_parallel_size_):
        for t in range(tensor_parallel_size_):
            data_ranks = [stage * per_stage + t + i * tensor_parallel_size_ for i in range(dp)]
            for i in range(0, dp, expert_parallel_size_):
                expert_groups.append(data_ranks[i:i + expert_parallel_size_])
            for j in range(expert_parallel_size_):
                expert_data_groups.append(data_ranks[j::expert_parallel_size_])
    return expert_groups, expert_data_groups
