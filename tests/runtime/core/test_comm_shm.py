"""dslaunch.runtime.comm.shm: collectives of same-host gloo groups through shared memory.

Each op, through dslaunch.runtime.comm with the transport on, against the same op with it
off (DSLAUNCH_SHM_COMM=0, plain gloo) on the same inputs: bit for bit on 2 ranks (a sum of
two is the same in any order), and on 3 ranks exactly for integers, MAX and MIN and to
rounding for float sums (gloo's ring adds in another order); all_to_all_single with even splits
(uneven ones stay on gloo: test_sequence_attention's uneven heads). Sizes cross the region size,
so every op runs in several chunks; a subgroup whose group ranks differ from its global
ranks is covered. Also: ranks killed while setting the segment up leave nothing in /dev/shm
(it is an anonymous file); a group where one rank cannot map the segment stays on gloo on
every rank; a peer that exits mid-wait is named.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from dist_harness import run_function

OPS = ("all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def _inputs(rank, world, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _run_op(comm, name, x, group, world, op, root):
    if name == "all_reduce":
        t = x.clone()
        comm.all_reduce(t, op=op, group=group)
        return t
    if name == "reduce":
        t = x.clone()
        comm.reduce(t, group_dst=root, op=op, group=group)
        return t
    if name == "all_gather_into_tensor":
        out = torch.empty(world * x.numel(), dtype=x.dtype)
        comm.all_gather_into_tensor(out, x, group=group)
        return out
    if name == "all_to_all_single":
        out = torch.empty_like(x)
        comm.all_to_all_single(out, x, group=group)
        return out
    n = x.numel() // world
    out = torch.empty(n, dtype=x.dtype)
    comm.reduce_scatter_tensor(out, x[:n * world].contiguous(), op=op, group=group)
    return out


def _ops_against_gloo(subgroup):
    import torch.distributed as dist
    from dslaunch.runtime import comm
    from dslaunch.runtime.comm import shm

    group = None
    if subgroup:  # ranks {0, 2} and {1, 3}: group ranks differ from global ranks
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group = groups[dist.get_rank() % 2]
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    big = shm.region_bytes(world) // 4 * 2 + 37  # float32 elements: three chunks (more for reduce_scatter)
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for numel in (9000 * world, big * world):
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                for name in OPS:
                    if name in ("all_gather_into_tensor", "all_to_all_single") and op != dist.ReduceOp.SUM:
                        continue
                    cases.append((dtype, numel, op, name))
    out = {"used": [], "mismatch": [], "max_err": 0.0, "a2a": [0, 0]}  # [cases, calls through the segment]
    through = shm.Segment.all_to_all

    def counted(self, *args):
        out["a2a"][1] += 1
        return through(self, *args)

    shm.Segment.all_to_all = counted
    for i, (dtype, numel, op, name) in enumerate(cases):
        out["a2a"][0] += name == "all_to_all_single"
        x = _inputs(dist.get_rank(), world, numel, dtype, i)
        root = i % world
        os.environ[shm.ENV] = "1"
        out["used"].append(shm.segment_for(group, x, op=None if name == "all_to_all_single" else op) is not None)
        mine = _run_op(comm, name, x, group, world, op, root)
        os.environ[shm.ENV] = "0"
        ref = _run_op(comm, name, x, group, world, op, root)
        if name == "reduce" and rank != root:
            continue  # off the root the buffer's contents are unspecified (gloo leaves partial sums)
        exact = world == 2 or not dtype.is_floating_point or op != dist.ReduceOp.SUM
        if exact:
            if not torch.equal(mine, ref):
                out["mismatch"].append((str(dtype), numel, str(op), name))
        else:
            err = float((mine.double() - ref.double()).abs().max() / ref.double().abs().max())
            out["max_err"] = max(out["max_err"], err)
    os.environ[shm.ENV] = "1"
    return out


@pytest.mark.parametrize("nprocs,subgroup", [(2, False), (3, False), (4, True)])
def test_every_op_equals_gloo(nprocs, subgroup):
    results = run_function(_ops_against_gloo, nprocs=nprocs, kwargs={"subgroup": subgroup}, timeout=300)
    for r, res in enumerate(results):
        assert all(res["used"]), f"rank {r}: a call went to gloo"
        assert res["a2a"][0] == res["a2a"][1] > 0, f"rank {r}: all-to-alls {res['a2a']} (cases, through the segment)"
        assert res["mismatch"] == [], f"rank {r}: {res['mismatch'][:5]}"
        assert res["max_err"] < 1e-2 if nprocs > 2 else res["max_err"] == 0.0  # bf16 sums of 3: rounding only


def _one_rank_cannot_map():
    import torch.distributed as dist
    from dslaunch.runtime import comm
    from dslaunch.runtime.comm import shm

    if dist.get_rank() == 1:
        real = shm.Segment.__init__

        def refuse(self, *a, **k):
            if not k.get("create", a[-1] if a else False):
                raise OSError("no common /dev/shm")
            real(self, *a, **k)
        shm.Segment.__init__ = refuse
    x = torch.full((50000,), float(dist.get_rank() + 1))
    comm.all_reduce(x)
    return shm.segment_for(None, x) is None, float(x[0])


def test_a_group_where_one_rank_cannot_map_stays_on_gloo_everywhere():
    assert run_function(_one_rank_cannot_map, nprocs=2) == [(True, 3.0), (True, 3.0)]


def _all_reduce_after_opt_out():
    import torch.distributed as dist
    from dslaunch.runtime import comm
    from dslaunch.runtime.comm import shm

    x = torch.full((50000,), float(dist.get_rank() + 1))
    comm.all_reduce(x)
    return shm.segment_for(None, x) is None, shm._segments == {}, float(x[0])


def test_opt_out_keeps_gloo():
    results = run_function(_all_reduce_after_opt_out, nprocs=2, env={"DSLAUNCH_SHM_COMM": "0"})
    assert results == [(True, True, 3.0), (True, True, 3.0)]


def test_a_peer_that_exits_is_named():
    from dslaunch.runtime.comm import shm

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    token = b"t" * 16
    seg = shm.Segment("", token, 0, 2, (0, 5), "world", create=True)
    seg.pids[1] = gone.pid  # rank 1 (global 5) "mapped" the segment and then exited
    start = time.monotonic()
    with pytest.raises(shm.PeerExited, match=rf"rank 5 \(pid {gone.pid}\) of group world exited during all_reduce"):
        seg.all_reduce(torch.ones(100000), torch.distributed.ReduceOp.SUM)
    assert time.monotonic() - start < 10


KILLED_IN_SETUP = r"""
import os, sys, time, torch
import torch.distributed as dist
from dslaunch.runtime import comm
from dslaunch.runtime.comm import shm
dist.init_process_group("gloo")
made = shm.Segment.__init__
def tell(self, *args, **kwargs):  # says when the segment exists, so the kill lands after it
    made(self, *args, **kwargs)
    print("made", self.path, self.size, flush=True)
shm.Segment.__init__ = tell
if dist.get_rank() == 0:
    comm.all_reduce(torch.ones(100000), group=None)  # makes the segment, then waits for rank 1
else:
    time.sleep(600)  # never comes
"""


def _shm_files_of(pid: int) -> set:
    """The files under /dev/shm that process `pid` has open or mapped, and its memfds (a memfd
    has no name there: /proc shows it as "/memfd:NAME (deleted)")."""
    held = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    held.add(parts[5].strip())
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return {h for h in held if h.startswith("/dev/shm/") or h.startswith("/memfd:")}


def test_ranks_killed_during_set_up_leave_nothing_behind(tmp_path):
    """Rank 0 has made the segment and waits for rank 1, which never comes; both are killed
    (as a launcher ends a failed job): none of the files the ranks held may be left in
    /dev/shm. Only their own files are looked at: other programs on the machine may make
    and remove files there meanwhile."""
    from dist_harness import free_port

    script = tmp_path / "setup.py"
    script.write_text(KILLED_IN_SETUP)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port, OMP_NUM_THREADS="1"))
             for r in range(2)]
    try:
        said = procs[0].stdout.readline().split()
        assert said[0] == "made", said
        path, size = said[1], int(said[2])
        assert os.stat(path).st_size == size  # the segment exists while rank 0 waits in the exchange
        time.sleep(0.2)
        assert procs[0].poll() is None
        held = set().union(*(_shm_files_of(p.pid) for p in procs))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "/memfd:dslaunch-comm (deleted)" in held, held  # the segment: a file with no name to leave
    named = {h for h in held if h.startswith("/dev/shm/")}
    assert {h for h in named if os.path.exists(h)} == set(), named
