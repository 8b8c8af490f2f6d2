"""Topology, grid, layer partitioning and schedules: pure code, checked against what
DeepSpeed 0.19.8 itself produces (tests/fixtures/deepspeed_pipe.json, made by
scripts/make_pipe_fixtures.py under real DeepSpeed) and against the 1F1B arithmetic."""
import json

import pytest

from dslaunch.runtime.pipe import schedule as S
from dslaunch.runtime.pipe.partition import (PartitionError, check_parts, partition_balanced, partition_layers,
                                             partition_uniform)
from dslaunch.runtime.topology import (MpuGrid, PipeDataParallelTopology, PipeModelDataParallelTopology,
                                       PipelineParallelGrid, ProcessTopology, TopologyError, default_topology)
import repo_paths

FIXTURE = json.load(open(repo_paths.FIXTURES / "deepspeed_pipe.json"))


def _topo(rec):
    axes, dims = rec["axes"], dict(zip(rec["axes"], rec["dims"]))
    if rec["kind"] == "pipe_data":
        return PipeDataParallelTopology(num_pp=dims["pipe"], num_dp=dims["data"])
    return PipeModelDataParallelTopology(num_pp=dims["pipe"], num_mp=dims["model"], num_dp=dims["data"])


def test_topology_matches_deepspeed():
    for rec in FIXTURE["topologies"]:
        topo = _topo(rec)
        n = topo.world_size()
        assert [list(topo.get_coord(r)) for r in range(n)] == rec["coords"], rec["dims"]
        assert {a: topo.get_axis_comm_lists(a) for a in rec["comm_lists"]} == rec["comm_lists"]
        assert [topo.get_rank_repr(r) for r in range(n)] == rec["rank_repr"]
        assert [topo.get_rank_repr(r, omit_axes=[]) for r in range(n)] == rec["rank_repr_all"]
        for axis, lists in rec["axis_lists"].items():
            assert [topo.get_axis_list(axis, i) for i in range(topo.get_dim(axis))] == lists
        for r in range(n):
            assert topo.get_rank(**topo.get_coord(r)._asdict()) == r


def test_grid_matches_deepspeed():
    for rec in FIXTURE["topologies"]:
        topo = _topo(rec)
        for r, want in enumerate(rec["grid"]):
            made = []
            g = PipelineParallelGrid(topo, rank=r, world_size=topo.world_size(),
                                     group_factory=lambda ranks: made.append(tuple(ranks)) or tuple(ranks))
            got = {
                "stage_id": g.get_stage_id(), "data_parallel_id": g.get_data_parallel_id(),
                "dp_group": list(g.get_data_parallel_group()), "pp_group": list(g.get_pipe_parallel_group()),
                "model_group": list(g.get_model_parallel_group()), "slice_group": list(g.get_slice_parallel_group()),
                "model_rank": g.get_model_parallel_rank(), "model_world": g.get_model_parallel_world_size(),
                "slice_rank": g.get_slice_parallel_rank(), "slice_world": g.get_slice_parallel_world_size(),
                "pipe_rank": g.get_pipe_parallel_rank(), "pipe_world": g.get_pipe_parallel_world_size(),
                "data_world": g.get_data_parallel_world_size(), "p2p_groups": g.p2p_groups,
                "stage_to_global": [g.stage_to_global(s) for s in range(g.get_pipe_parallel_world_size())],
            }
            assert got == want, (rec["dims"], r)
            assert g.get_data_parallel_group_ranks() == want["dp_group"]
            assert g.get_tensor_model_parallel_group() is g.get_slice_parallel_group()
            # each group is created once; a one-rank group only by its member
            assert len(made) == len(set(made))
            assert all(len(m) > 1 or m == (r,) for m in made)


def test_default_topology_matches_deepspeed():
    for rec in FIXTURE["default_grids"]:
        topo = default_topology(rec["world"])
        assert (topo.get_axis_names(), [topo.get_dim(a) for a in topo.get_axis_names()]) == (rec["axes"], rec["dims"])


def test_topology_errors():
    with pytest.raises(TopologyError, match="dims"):
        ProcessTopology(["pipe", "data"], [2])
    with pytest.raises(TopologyError, match=">= 1"):
        PipeDataParallelTopology(num_pp=0, num_dp=2)
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2)
    with pytest.raises(TopologyError, match="exactly the axes"):
        topo.get_rank(pipe=0)
    with pytest.raises(TopologyError, match="outside"):
        topo.get_rank(pipe=2, data=0, model=0)
    with pytest.raises(TopologyError, match="not in this topology"):
        topo.get_coord(4)
    with pytest.raises(TopologyError, match="has 4 ranks but the job has 2"):
        PipelineParallelGrid(topo, rank=0, world_size=2, group_factory=tuple)
    assert topo.get_dim("nope") == 0 and topo.get_axis_comm_lists("nope") == []
    assert topo.filter_match(pipe=1) == [2, 3]


def test_mpu_adapter():
    class Mpu:
        def get_model_parallel_rank(self): return 1
        def get_model_parallel_world_size(self): return 2
        def get_model_parallel_group(self): return "mp"
        def get_data_parallel_rank(self): return 0
        def get_data_parallel_world_size(self): return 3
        def get_data_parallel_group(self): return "dp"

    g = MpuGrid(Mpu(), global_rank=5)
    assert (g.get_data_parallel_group(), g.get_data_parallel_world_size(), g.get_data_parallel_rank()) == ("dp", 3, 0)
    assert (g.get_model_parallel_group(), g.get_model_parallel_rank(), g.get_pipe_parallel_rank()) == ("mp", 1, 0)
    assert g.get_slice_parallel_rank() == 1 and g.get_global_rank() == 5

    class Half:
        def get_model_parallel_rank(self): return 0

    with pytest.raises(TopologyError, match="lacks get_model_parallel_world_size, get_model_parallel_group"):
        MpuGrid(Half())


def test_partitions_match_deepspeed():
    for rec in FIXTURE["partitions"]:
        assert partition_balanced(rec["weights"], rec["num_parts"]) == rec["balanced"], rec
        assert partition_uniform(len(rec["weights"]), rec["num_parts"]) == rec["uniform"], rec


def test_runtime_utils_partition_balanced_is_deepspeeds():
    """`deepspeed.runtime.utils.partition_balanced` (its import path maps to dslaunch.runtime.utils)
    is the pipeline's partitioner; cuts as DeepSpeed 0.19.8's function gives them, fewer items
    than parts included."""
    from dslaunch.runtime import utils

    cases = [([1, 2, 1], 4, [0, 1, 2, 3, 3]), ([1, 1, 1, 1, 1], 4, [0, 2, 3, 4, 5]),
             ([1, 1, 1, 1, 0, 1], 4, [0, 2, 3, 5, 6]), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 4, [0, 5, 6, 8, 10])]
    for weights, parts, ds in cases:
        assert utils.partition_balanced(weights=weights, num_parts=parts) == ds


def test_partition_methods_and_errors():
    class Block:
        pass

    class Other:
        pass

    layers = [Other(), Block(), Block(), lambda x: x, Block(), Block(), Other()]
    assert partition_layers(layers, 2, "type:block", lambda l: 0) == [0, 4, 7]
    assert partition_layers(layers, 3, "uniform", None) == [0, 3, 5, 7]
    assert partition_layers(layers, 2, "parameters", lambda l: 10 if isinstance(l, Block) else 0) == [0, 4, 7]
    with pytest.raises(PartitionError, match="no layer's type matches 'attn'"):
        partition_layers(layers, 2, "type:attn", None)
    with pytest.raises(PartitionError, match="stage 1 is left with no 'other' layer \\(2 match, 3 stages\\)"):
        partition_layers(layers, 3, "type:other", None)
    with pytest.raises(PartitionError, match="unknown"):
        partition_layers(layers, 2, "profile", None)
    with pytest.raises(PartitionError, match="3 stages but only 2 layers"):
        check_parts([0, 1, 2, 2], 2)
    with pytest.raises(PartitionError, match="stage 1 gets no layers"):
        check_parts([0, 2, 2, 3], 3)


def test_schedules_match_deepspeed():
    for rec in FIXTURE["schedules"]:
        m, p = rec["micro_batches"], rec["stages"]
        for s in range(p):
            assert [[repr(c) for c in step] for step in S.TrainSchedule(m, p, s)] == rec["train"][s], (m, p, s)
            assert [[repr(c) for c in step] for step in S.InferenceSchedule(m, p, s)] == rec["inference"][s]
            assert S.TrainSchedule(m, p, s).num_pipe_buffers() == rec["train_buffers"][s]


@pytest.mark.parametrize("m,p", [(1, 1), (4, 2), (8, 4), (3, 4), (16, 3)])
def test_train_schedule_is_1f1b(m, p):
    """Every micro-batch is loaded, run forward and backward once per stage, forward
    before backward, never more than p - s activations alive; each send meets the
    neighbour's receive in the same step; compute fills 2m of 2(m+p-1) steps."""
    streams = [list(S.TrainSchedule(m, p, s)) for s in range(p)]
    assert all(len(st) == 2 * (m + p - 1) for st in streams)
    for s, st in enumerate(streams):
        busy = sum(1 for step in st if any(isinstance(c, (S.ForwardPass, S.BackwardPass)) for c in step))
        assert busy == 2 * m
        alive = peak = 0
        for step in st:
            for c in step:
                alive += isinstance(c, S.ForwardPass) - isinstance(c, S.BackwardPass)
            peak = max(peak, alive)
        assert peak <= p - s
        assert [type(c) for c in st[-1][-3:]] == [S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep]
        loads = sum(isinstance(c, S.LoadMicroBatch) for step in st for c in step)
        assert loads == (m if s in (0, p - 1) else 0)
    for t in range(2 * (m + p - 1)):
        for s in range(p - 1):
            sends = [c for c in streams[s][t] if isinstance(c, S.SendActivation)]
            recvs = [c for c in streams[s + 1][t] if isinstance(c, S.RecvActivation)]
            assert len(sends) == len(recvs)
            assert (len([c for c in streams[s + 1][t] if isinstance(c, S.SendGrad)])
                    == len([c for c in streams[s][t] if isinstance(c, S.RecvGrad)]))
    assert S.bubble_fraction(m, p) == (p - 1) / (m + p - 1)


def test_schedule_rejects_bad_shapes():
    with pytest.raises(ValueError, match="stage_id"):
        S.TrainSchedule(4, 2, 2)
    with pytest.raises(ValueError):
        S.InferenceSchedule(0, 2, 0)
