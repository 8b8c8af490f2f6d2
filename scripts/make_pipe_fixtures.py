"""Record DeepSpeed's pipeline contract as a test fixture: topology coordinates and
communicator lists, layer partitions, and the TrainSchedule / InferenceSchedule
instruction streams, for many shapes.

    /work/ds-venv/bin/python scripts/make_pipe_fixtures.py     # real DeepSpeed, CPU
    -> tests/fixtures/deepspeed_pipe.json

The test suite never imports DeepSpeed; tests/runtime/pipe/test_pipe_pure.py compares our pure
topology, partition and schedule code with this file.
"""
import json
import os
import sys

from deepspeed.runtime.pipe import schedule as S
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology, PipelineParallelGrid
from deepspeed.runtime import utils
import deepspeed

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "deepspeed_pipe.json")


def topology_record(topo):
    n = topo.world_size()
    return {
        "axes": topo.get_axis_names(), "dims": [topo.get_dim(a) for a in topo.get_axis_names()],
        "coords": [list(topo.get_coord(r)) for r in range(n)],
        "comm_lists": {a: topo.get_axis_comm_lists(a) for a in topo.get_axis_names() + ["nope"]},
        "rank_repr": [topo.get_rank_repr(r) for r in range(n)],
        "rank_repr_all": [topo.get_rank_repr(r, omit_axes=[]) for r in range(n)],
        "axis_lists": {a: [topo.get_axis_list(a, i) for i in range(topo.get_dim(a))] for a in topo.get_axis_names()},
    }


class _FakeDist:
    """Stands in for deepspeed.comm so DeepSpeed's grid can be built for any rank in one
    process: a "group" is the tuple of its ranks."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world

    def new_group(self, ranks):
        return tuple(sorted(ranks))


def grid_record(topo):
    import deepspeed.runtime.pipe.topology as T

    real = T.dist
    out = []
    try:
        for r in range(topo.world_size()):
            T.dist = _FakeDist(r, topo.world_size())
            g = PipelineParallelGrid(topology=topo)
            out.append({
                "stage_id": g.get_stage_id(), "data_parallel_id": g.get_data_parallel_id(),
                "dp_group": list(g.get_data_parallel_group()), "pp_group": list(g.get_pipe_parallel_group()),
                "model_group": list(g.get_model_parallel_group()), "slice_group": list(g.get_slice_parallel_group()),
                "model_rank": g.get_model_parallel_rank(), "model_world": g.get_model_parallel_world_size(),
                "slice_rank": g.get_slice_parallel_rank(), "slice_world": g.get_slice_parallel_world_size(),
                "pipe_rank": g.get_pipe_parallel_rank(), "pipe_world": g.get_pipe_parallel_world_size(),
                "data_world": g.get_data_parallel_world_size(), "p2p_groups": g.p2p_groups,
                "stage_to_global": [g.stage_to_global(s) for s in range(g.get_pipe_parallel_world_size())],
            })
    finally:
        T.dist = real
    return out


def default_grid_record(world):
    import deepspeed.runtime.pipe.topology as T

    real = T.dist
    try:
        T.dist = _FakeDist(0, world)
        g = PipelineParallelGrid()
        topo = g.topology()
        return {"world": world, "axes": topo.get_axis_names(), "dims": [topo.get_dim(a) for a in topo.get_axis_names()]}
    finally:
        T.dist = real


def schedule_record(cls, m, p):
    return [[[repr(c) for c in step] for step in cls(micro_batches=m, stages=p, stage_id=s)] for s in range(p)]


def main():
    topos = []
    for pp, mp, dp in [(1, 1, 1), (2, 1, 1), (2, 1, 2), (2, 2, 2), (4, 1, 1), (1, 2, 2), (3, 2, 1), (2, 3, 2)]:
        rec = topology_record(PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp))
        rec["kind"] = "pipe_model_data"
        rec["grid"] = grid_record(PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=dp))
        topos.append(rec)
    for pp, dp in [(2, 2), (3, 1), (1, 4)]:
        rec = topology_record(PipeDataParallelTopology(num_pp=pp, num_dp=dp))
        rec["kind"] = "pipe_data"
        rec["grid"] = grid_record(PipeDataParallelTopology(num_pp=pp, num_dp=dp))
        topos.append(rec)
    weights = [[3, 1, 4, 1, 5, 9, 2, 6], [0, 10, 10, 10, 10, 0], [1] * 7, [0, 5, 0, 0, 5, 0, 5],
               [100, 1, 1, 1, 1, 1, 1, 1, 1, 100], [1, 1], [7]]
    partitions = []
    for w in weights:
        for parts in (1, 2, 3, 4):
            partitions.append({"weights": w, "num_parts": parts,
                               "balanced": [int(x) for x in utils.partition_balanced(w, parts)],
                               "uniform": [int(x) for x in utils.partition_uniform(len(w), parts)]})
    schedules = []
    for p in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8):
            schedules.append({"stages": p, "micro_batches": m,
                              "train": schedule_record(S.TrainSchedule, m, p),
                              "train_buffers": [S.TrainSchedule(m, p, s).num_pipe_buffers() for s in range(p)],
                              "inference": schedule_record(S.InferenceSchedule, m, p)})
    data = {"deepspeed_version": deepspeed.__version__, "topologies": topos,
            "default_grids": [default_grid_record(w) for w in (1, 2, 4, 6, 8, 12, 16)], "partitions": partitions,
            "schedules": schedules}
    with open(OUT, "w") as fh:
        json.dump(data, fh, separators=(",", ":"))
    print(f"wrote {os.path.relpath(OUT)} ({os.path.getsize(OUT)} bytes) from DeepSpeed {deepspeed.__version__}")


if __name__ == "__main__":
    sys.exit(main())
