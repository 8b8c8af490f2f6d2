"""The named-axis process mesh (runtime/core/parallel): degrees checked in one place, groups by
axis name, DeepSpeed's rank order, expert and sequence groups, the mpu adapter. Pure: the
meshes are built without processes (group_factory records the rank lists)."""
import pytest

from dslaunch.runtime.parallel import (MeshDims, MeshError, MpuMesh, PipelineParallelGrid, ProcessMesh,
                                       PipeModelDataParallelTopology, topology_for)


def mesh(world, rank, **degrees):
    expert = degrees.get("expert", 1)
    return ProcessMesh(topology_for(MeshDims.for_world(world, **degrees)), expert=expert, rank=rank,
                       world_size=world, group_factory=tuple)


@pytest.mark.parametrize("world,degrees,message", [
    (8, dict(tensor=3), "tensor 3 does not divide world 8"),
    (8, dict(pipe=3), "pipe 3 does not divide world 8"),
    (8, dict(pipe=4, tensor=4), "pipe 4 x sequence 1 x tensor 4 = 16 does not divide world 8"),
    (8, dict(expert=3), "expert 3 does not divide data 8"),
    (8, dict(tensor=2, expert=3), "expert 3 does not divide data 4"),
    (8, dict(tensor=0), "tensor 0 must be a positive integer"),
])
def test_bad_degrees_are_one_line_naming_the_value(world, degrees, message):
    with pytest.raises(MeshError) as info:
        MeshDims.for_world(world, **degrees)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_data_takes_what_the_other_degrees_leave():
    d = MeshDims.for_world(16, pipe=2, tensor=2, sequence=2, expert=2)
    assert (d.pipe, d.data, d.sequence, d.tensor, d.expert, d.expert_data) == (2, 2, 2, 2, 2, 1)
    assert d.world == 16


def test_rank_order_is_deepspeeds_tensor_fastest_then_data_then_pipe():
    # pp=2 x dp=2 x tp=2: DeepSpeed's PipeModelDataParallelTopology puts tensor ranks adjacent
    m = mesh(8, 5, pipe=2, tensor=2)
    assert m.ranks("tensor") == [4, 5] and m.rank("tensor") == 1
    assert m.ranks("data") == [5, 7] and m.rank("data") == 0
    assert m.ranks("pipe") == [1, 5] and m.rank("pipe") == 1
    assert m.ranks("replica") == [0, 1, 4, 5]  # DeepSpeed's "model parallel" group: pipe x tensor
    assert m.comm_lists("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.size("world") == 8 and m.group("data") == (5, 7)
    same = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert m.topology().mapping == same.mapping


def test_expert_groups_are_cut_from_data_groups_as_deepspeed_does():
    # DeepSpeed's _create_expert_and_data_parallel(ep_size=2) on 8 ranks: expert groups of
    # consecutive ranks, expert-data groups strided by ep_size
    m = mesh(8, 5, expert=2)
    assert m.comm_lists("expert") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.comm_lists("expert_data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert (m.ranks("expert"), m.rank("expert"), m.size("expert_data")) == ([4, 5], 1, 4)
    # with tensor parallelism the expert groups live inside each tensor slice's data group
    t = mesh(8, 2, tensor=2, expert=2)
    assert t.comm_lists("expert") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert t.ranks("expert_data") == [2, 6]


def test_sequence_axis_and_the_data_sequence_group():
    m = mesh(8, 5, sequence=2, tensor=2)
    assert m.ranks("tensor") == [4, 5] and m.ranks("sequence") == [5, 7] and m.ranks("data") == [1, 5]
    assert m.ranks("data_sequence") == [1, 3, 5, 7]
    plain = mesh(4, 1)
    assert plain.ranks("data_sequence") == plain.ranks("data") == [0, 1, 2, 3]
    assert plain.size("tensor") == plain.size("sequence") == plain.size("expert") == 1


def test_unknown_axis_is_one_line():
    with pytest.raises(MeshError, match="mesh axis 'model' does not exist"):
        mesh(4, 0).group("model")


def test_the_grid_is_the_mesh_through_deepspeeds_getters():
    g = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2), rank=6, world_size=8,
                             group_factory=tuple)
    assert g.get_data_parallel_group() == g.group("data") == (4, 6)
    assert g.get_slice_parallel_group() == g.get_tensor_model_parallel_group() == g.group("tensor") == (6, 7)
    assert g.get_model_parallel_group() == g.group("replica")
    assert (g.get_tensor_model_parallel_rank(), g.get_data_parallel_rank(), g.get_stage_id()) == (0, 1, 1)
    assert g._is_grid_valid()  # DeepSpeed's tests assert it; a grid of the wrong size is never built


def test_a_grid_of_another_size_than_the_job_is_refused_naming_both():
    with pytest.raises(MeshError, match="has 8 ranks but the job has 4"):
        PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2), rank=0, world_size=4,
                             group_factory=tuple)


class _Mpu:
    def __init__(self, tp_rank):
        self.tp_rank = tp_rank

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return 2

    def get_model_parallel_group(self):
        return "model-group"

    def get_data_parallel_rank(self):
        return 1

    def get_data_parallel_world_size(self):
        return 3

    def get_data_parallel_group(self):
        return "data-group"


def test_mpu_adapter_answers_by_axis_name_with_the_mpus_own_groups():
    m = MpuMesh(_Mpu(1), global_rank=3)
    assert (m.size("data"), m.rank("data"), m.group("data")) == (3, 1, "data-group")
    assert (m.size("tensor"), m.rank("tensor"), m.group("tensor")) == (2, 1, "model-group")
    assert (m.size("pipe"), m.rank("pipe"), m.group("pipe")) == (1, 0, None)
    assert m.size("data_sequence") == 3
    with pytest.raises(MeshError, match="does not describe expert parallelism"):
        m.size("expert")
    with pytest.raises(MeshError, match="lacks .*get_data_parallel_group"):
        MpuMesh(object())
