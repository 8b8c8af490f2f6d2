"""dslaunch.runtime.comm: the one module every collective of the runtime goes through.

- A source check: no torch.distributed collective is called in runtime/ outside core/comm/, and
  every comm collective called there names its group.
- One 4-rank gloo job (two groups {0,2} and {1,3}, so group ranks differ from global ranks)
  runs each op through `deepspeed.comm` after `import dslaunch.runtime as deepspeed`,
  native and gloo-fallback paths of reduce_scatter_tensor / all_gather_into_tensor, with
  the flight record and the comms logger's summary checked on the way.
"""
import ast
import os

import pytest

from dist_harness import run_function
import repo_paths

ROOT = str(repo_paths.ROOT)
RUNTIME = os.path.join(ROOT, "runtime")
COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
               "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "inference_all_reduce", "allgather_fn",
               "reduce_scatter_fn"}


def _calls(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            yield node.func.value.id, node.func.attr, node


def test_every_runtime_collective_goes_through_comm_and_names_its_group():
    direct, unnamed, seen = [], [], 0
    for folder, _, files in os.walk(RUNTIME):
        if os.path.join(RUNTIME, "core", "comm") in folder:
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            rel = os.path.relpath(path, ROOT)
            for mod, name, node in _calls(path):
                if name not in COLLECTIVES:
                    continue
                if mod == "dist":
                    direct.append(f"{rel}:{node.lineno} dist.{name}")
                elif mod == "comm":
                    seen += 1
                    if not any(k.arg == "group" for k in node.keywords):
                        unnamed.append(f"{rel}:{node.lineno} comm.{name}")
    assert not direct, "torch.distributed collectives called outside runtime/core/comm: " + ", ".join(direct)
    assert not unnamed, "comm collectives without group=: " + ", ".join(unnamed)
    assert seen >= 10  # the check is looking at the real call sites


def _ops_worker():
    import torch
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    comm = deepspeed.comm
    comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=True)  # already up: a no-op
    rank, world = comm.get_rank(), comm.get_world_size()
    ranks = [r for r in range(world) if r % 2 == rank % 2]
    groups = {p: comm.new_group([r for r in range(world) if r % 2 == p], name=f"parity {p}") for p in (0, 1)}
    g = groups[rank % 2]
    me, n = comm.get_rank(g), comm.get_world_size(g)
    out = {"rank": rank, "me": me, "n": n, "ranks": comm.get_all_ranks_from_group(g)}

    comm.configure(enabled=True, prof_all=True)
    flat = torch.arange(8, dtype=torch.float32) * (rank + 1)
    for fallback in (False, True):
        comm.force_fallback(fallback)
        part = torch.empty(8 // n)
        comm.reduce_scatter_tensor(part, flat, group=g, label="test rs")
        full = torch.empty(8)
        comm.all_gather_into_tensor(full, part, group=g, label="test ag")
        out[("rs", fallback)] = part.tolist()
        out[("ag", fallback)] = full.tolist()
    comm.force_fallback(False)

    t = torch.tensor([float(rank)])
    comm.broadcast(t, group_src=1, group=g)
    out["bcast"] = t.item()
    t = torch.tensor([float(rank + 1)])
    with comm.labelled("scoped reduce"):  # deepspeed.comm's signature, the label from the block
        comm.reduce(t, comm.get_global_rank(g, 1), comm.ReduceOp.SUM, g, False)
    out["reduce"] = t.item() if me == 1 else None
    t = torch.tensor([1.0])
    work = comm.all_reduce(t, group=None, async_op=True, label="async world")
    work.wait()
    out["world_sum"] = t.item()
    objs = [None] * n
    comm.all_gather_object(objs, {"rank": rank}, group=g)
    out["objs"] = objs
    # point to point inside the group: group rank 0 sends to group rank 1
    buf = torch.zeros(3)
    if me == 0:
        comm.send(torch.full((3,), float(rank)), group_dst=1, group=g)
    else:
        comm.recv(buf, group_src=0, group=g)
    out["recv"] = buf.tolist()
    comm.barrier(group=g)
    out["flight"] = comm.flight_record()
    out["summary"] = comm.log_summary(return_dict=True)["summary"]
    out["logged_ops"] = comm.get_logged_comm_ops()
    comm.configure(enabled=False)
    out["same_group_object"] = comm.get_world_group() is dist.group.WORLD
    return out


@pytest.mark.timeout(150)
def test_ops_on_subgroups_through_deepspeed_comm():
    results = run_function(_ops_worker, nprocs=4, timeout=130)
    for res in results:
        rank, me = res["rank"], res["me"]
        peers = [r for r in range(4) if r % 2 == rank % 2]
        assert res["n"] == 2 and res["ranks"] == peers and me == peers.index(rank)
        # sum over the group of (r+1) * arange(8), split in group-rank halves
        total = [float(i * sum(r + 1 for r in peers)) for i in range(8)]
        for fallback in (False, True):
            assert res[("rs", fallback)] == total[me * 4:(me + 1) * 4]
            assert res[("ag", fallback)] == total
        assert res["bcast"] == float(peers[1])  # group rank 1 is global rank 2 or 3
        if me == 1:
            assert res["reduce"] == float(sum(r + 1 for r in peers))
        assert res["world_sum"] == 4.0
        assert res["objs"] == [{"rank": r} for r in peers]
        if me == 1:
            assert res["recv"] == [float(peers[0])] * 3
        assert res["same_group_object"]
        # flight record: sequence numbers count per group; names and labels are kept
        fl = res["flight"]
        on_group = [e for e in fl if e["group"] == f"parity {rank % 2}" and not e["op"] in ("send", "recv")]
        assert [e["seq"] for e in on_group] == list(range(1, len(on_group) + 1))
        assert [e["op"] for e in on_group[:2]] == ["reduce_scatter_tensor", "all_gather_into_tensor"]
        assert on_group[0]["label"] == "test rs" and on_group[0]["nbytes"] == 32
        reduces = [e for e in on_group if e["op"] == "reduce"]
        assert [e["label"] for e in reduces] == ["scoped reduce"]
        assert on_group[-1]["op"] == "barrier" and on_group[-1]["label"] == ""  # the block is over
        world = [e for e in fl if e["group"] == "world"]
        assert world[0]["op"] == "all_reduce" and world[0]["label"] == "async world"
        assert all(e["state"] == "done" for e in fl)
        # comms logger: a row per op and message size
        summary = res["summary"]
        assert summary["reduce_scatter_tensor"][32]["count"] == 2  # native and fallback
        assert summary["all_gather_into_tensor"][32]["count"] == 2
        assert summary["all_reduce"][4]["groups"] == ["world"]
        assert "log_summary_barrier" in res["logged_ops"]


def test_bandwidth_formulas_and_table():
    from dslaunch.runtime.comm.logger import CommsLogger, bandwidths_gbps

    assert bandwidths_gbps("all_reduce", 10**9, 1.0, 4) == (8.0, 8.0 * 2 * 3 / 4)
    assert bandwidths_gbps("all_gather_into_tensor", 10**9, 2.0, 4) == (4.0, 3.0)
    assert bandwidths_gbps("broadcast", 10**9, 1.0, 8) == (8.0, 8.0)
    log = CommsLogger()
    log.configure(enabled=True, prof_all=False, prof_ops=["all_reduce"])
    assert log.wants("all_reduce", False) and not log.wants("broadcast", False) and log.wants("broadcast", True)
    log.record("all_reduce", "all_reduce", 1024, 0.002, "world", 2)
    log.record("all_reduce", "all_reduce", 1024, 0.004, "world", 2)
    log.record("all_reduce", "all_reduce", 4096, 0.001, "ranks 0,1", 2)
    table = log.summary().splitlines()
    assert table[0].split()[:2] == ["Comm.", "Op"] and "busbw_avg" in table[0]
    assert table[2].split()[:5] == ["all_reduce", "1.00", "KB", "2", "6.00"]
    assert table[3].split()[:4] == ["4.00", "KB", "1", "1.00"]
    assert log.total_operations() == 3


def test_comms_logger_under_deepspeeds_names():
    """DeepSpeed's CommsLogger API on the same logger: the comms_dict layout (parallel lists
    in record order), the per-size summary with 10%-trimmed means, and the switches. The
    numbers are real DeepSpeed 0.19.8's for the same records."""
    from dslaunch.runtime.comm.logger import CommsLogger, trim_mean

    log = CommsLogger()
    log.configure(enabled=True)
    log.record("all_reduce", "all_reduce", 1024, 0.002, "world", 2)
    log.record("all_reduce", "all_reduce", 1024, 0.004, "world", 2)
    raw = log.get_raw_data()["all_reduce"][1024]
    assert raw[0] == 2 and raw[1] == pytest.approx([2.0, 4.0])  # count, then latencies in ms, in record order
    latencies = [float(x) for x in (5, 1, 9, 2, 8, 3, 7, 4, 6, 10, 100)]
    algbws = [float(x) for x in range(11, 0, -1)]
    log.comms_dict = {"all_reduce": {1024: [11, list(latencies), list(algbws), [2 * a for a in algbws]]}}
    summary = log.get_operation_summary("all_reduce")[1024]
    # DeepSpeed 0.19.8, same comms_dict: count 11, total 155.0, avg latency 6.0, tput 6.0, busbw 12.0
    assert (summary["count"], summary["total_latency_ms"], summary["avg_latency_ms"], summary["tput_avg_gbps"],
            summary["busbw_avg_gbps"]) == (11, 155.0, 6.0, 6.0, 12.0)
    assert log.get_raw_data()["all_reduce"][1024][1] == latencies  # summarising sorted copies only
    assert log.get_operation_summary("broadcast") is None
    assert log.get_total_operations() == 11 and log.get_operation_names() == ["all_reduce"]
    assert trim_mean([3.0, 1.0, 2.0, 50.0], 0.25) == 2.5  # DeepSpeed's trim_mean gives 2.5
    log.stop_profiling_comms()
    assert log.prof_all is False and not log.wants("all_reduce", False)
    log.start_profiling_op(["all_reduce", "broadcast"])
    log.stop_profiling_op(["broadcast"])
    assert log.prof_ops == ["all_reduce"] and log.wants("all_reduce", False)
    log.start_profiling_comms()
    assert log.wants("barrier", False)
    log.reset_data()
    assert not log.has_data()


LOGGER_SCRIPT = r'''
import torch
import dslaunch.runtime as deepspeed

cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1},
       "comms_logger": {"enabled": True, "verbose": True, "prof_all": False, "debug": True,
                        "prof_ops": ["reduce", "all_gather_into_tensor"]}}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
for step in range(3):
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
print("SUMMARY-CALL", flush=True)
deepspeed.comm.log_summary()
print("SUMMARY-DONE", flush=True)
'''


@pytest.mark.timeout(120)
def test_comms_logger_from_the_config(tmp_path):
    """comms_logger through the config: only prof_ops are recorded, verbose prints each op,
    debug names the calling function, log_summary() and the end-of-run summary print the
    table on rank 0."""
    from dist_harness import run_script

    script = tmp_path / "logged.py"
    script.write_text(LOGGER_SCRIPT)
    runs = run_script([str(script)], nprocs=2, timeout=100)
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    out0 = runs[0].stdout
    table = out0.split("SUMMARY-CALL", 1)[1].split("SUMMARY-DONE", 1)[0].strip().splitlines()
    assert table[0].split()[:2] == ["Comm.", "Op"]
    rows = {ln.split()[0] for ln in table[2:] if ln and not ln[0].isspace()}
    assert rows == {"all_gather_into_tensor", "reduce"}  # not the broadcasts or the norm's all_reduce
    # 90 fp32 parameters padded to 92 (DeepSpeed's alignment, 2 x world), 46 per rank. Each of 3 steps:
    # one all-gather (368 B out) and a reduce of each owner's gradients in backward (46 and 44 floats)
    row = next(ln for ln in table if ln.startswith("all_gather_into_tensor")).split("]", 1)[1].split()
    assert row[:3] == ["368", "B", "3"], table
    i = next(i for i, ln in enumerate(table) if ln.startswith("reduce "))
    sizes = sorted(tuple((ln.split("]", 1)[1] if "]" in ln else ln).split()[:3]) for ln in table[i:i + 2])
    assert sizes == [("176", "B", "3"), ("184", "B", "3")], table
    assert "reduce | [Caller Func: _reduce_bucket]" in out0  # debug
    assert "all_gather_into_tensor | [Caller Func: sync_params]" in out0
    assert "comm op: all_gather_into_tensor | [Caller Func: sync_params] | group: world" in runs[0].stderr  # verbose
    tail = out0.split("SUMMARY-DONE", 1)[1]
    assert "comms_logger: communication summary of rank 0 at exit" in tail and "all_gather_into_tensor" in tail
    assert "SUMMARY-DONE" in runs[1].stdout and "Comm. Op" not in runs[1].stdout  # rank 0 prints, rank 1 does not


def _handles_worker():
    import weakref

    import torch

    import dslaunch.runtime as deepspeed

    comm = deepspeed.comm
    out = torch.empty(2 * 1000)
    work = comm.all_gather_into_tensor(out, torch.ones(1000), async_op=True, label="async ag")
    work.wait()
    gone = weakref.ref(out)
    del out, work
    comm.all_reduce(torch.ones(1), label="next")  # a later collective: completed handles are let go
    return gone() is None, [e["state"] for e in comm.flight_record() if e["label"] == "async ag"]


def test_completed_async_handles_do_not_keep_their_tensors():
    # a torch Work keeps the collective's tensors alive: ZeRO-3's async prefetch would otherwise hold
    # gathered parameters (up to the flight record's depth of them) after releasing them
    for freed, states in run_function(_handles_worker, nprocs=2, timeout=60):
        assert freed and states == ["done"]


ONE_PROCESS_TWICE = r"""
import os, subprocess, sys
import torch.distributed as dist
import dslaunch.runtime as deepspeed

for var in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "DSLAUNCH_ONE_PROCESS_PORT"):
    os.environ.pop(var, None)
deepspeed.init_distributed()
first = os.environ["MASTER_PORT"]
# the store of the first group is still alive in this process while a child and a second group start
child = subprocess.run([sys.executable, "-c", "import dslaunch.runtime as d; d.init_distributed(); print('child ok')"],
                       capture_output=True, text=True, timeout=120)
print(child.stdout.strip() or child.stderr[-2000:])
store = dist.distributed_c10d._get_default_store()
dist.destroy_process_group()
deepspeed.init_distributed()
print("second ok", os.environ["MASTER_PORT"] != first)
dist.destroy_process_group()
"""


def test_one_process_groups_never_reuse_a_port_a_store_may_still_hold(tmp_path):
    """A one-process init_distributed lets its store bind port 0 and names the port in
    MASTER_PORT; a later one-process init, in this process or in a child that inherits the
    variable, binds a new one instead of colliding with a store still alive."""
    import subprocess
    import sys

    script = tmp_path / "twice.py"
    script.write_text(ONE_PROCESS_TWICE)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["child", "ok", "second", "ok", "True"], res.stdout + res.stderr[-2000:]


NOT_INITIALIZED = """
import torch
import dslaunch.runtime as deepspeed
try:
    deepspeed.init_distributed(dist_init_required=False)
except AssertionError as exc:  # DeepSpeed asserts here; its tests catch AssertionError
    print("refused:", exc)
model = torch.nn.Linear(2, 2)
deepspeed.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                     config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
"""


def test_dist_init_required_false_without_a_process_group_is_refused(tmp_path):
    """DeepSpeed asserts when dist_init_required=False finds no process group; going on would
    leave each rank of a launch training alone. Uncaught, it is one line and exit status 2."""
    import subprocess
    import sys

    script = tmp_path / "no_init.py"
    script.write_text(NOT_INITIALIZED)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    line = ("dist_init_required=False, but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first, or leave dist_init_required unset (initialized here)")
    assert res.stdout.strip() == "refused: " + line, res.stdout + res.stderr[-2000:]
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1].endswith(line), res.stderr[-2000:]
