"""The collective watchdog (issue #9 item 8), through dslaunch and the public API.

Three 2-rank jobs under `dslaunch` with a 5 s timeout: one where rank 1 sleeps inside a
training step while rank 0 waits in the engine's gradient all_reduce (timeout from the
config's comms_timeout), one where the ranks call different collectives (timeout from
init_distributed(timeout=)), and a two-stage pipeline whose first stage stalls in a layer's
forward while the second waits in recv for its activations. Each must end (exit 124, named by dslaunch as the failure) within timeout +
10 s of the hang, with both ranks' Python stacks and flight records printed and the
mismatch named. The pure parts (sequence numbers, the mismatch line) are tested directly.
"""
import os
import re
import subprocess
import sys
import time

import pytest

DSLAUNCH = os.path.join(os.path.dirname(sys.executable), "dslaunch")
TIMEOUT_S = 5.0

SCRIPT = r'''
import os, sys, time
import torch
import torch._dynamo  # the first optimizer imports it: seconds on a loaded machine, done here, before any
                      # collective, so that no rank waits for another one's import longer than the timeout
import dslaunch.runtime as deepspeed

case = os.environ["HANG_CASE"]
comm = deepspeed.comm
timeout = float(os.environ["COMMS_TIMEOUT"])
if case == "sleep":  # the engine, with the timeout from the config
    torch.manual_seed(0)
    width = int(os.environ.get("HANG_WIDTH", "4"))  # 128: a 64 KiB bucket, reduced through shared memory
    model = torch.nn.Linear(width, width)
    cfg = {"train_micro_batch_size_per_gpu": 2, "comms_timeout": timeout,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rank = engine.global_rank
elif case == "pipe":  # two pipeline stages; stage 0 stalls in a layer, stage 1 waits in recv
    stall = {"on": False}

    class Stall(torch.nn.Module):
        def forward(self, x):
            if stall["on"]:
                time.sleep(600)  # stuck in user code, inside stage 0's forward
            return x

    torch.manual_seed(0)
    net = deepspeed.pipe.PipelineModule(layers=[Stall(), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)],
                                        num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "comms_timeout": timeout,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
    rank = engine.global_rank
    batches = iter([(torch.ones(2, 4), torch.zeros(2, 4))] * 4)
    engine.train_batch(batches)  # one whole batch through both stages first
else:
    deepspeed.init_distributed(timeout=timeout)
    rank = comm.get_rank()
for i in range(3):
    comm.all_reduce(torch.ones(4), group=None, label=f"warm-up {i}")


def step():
    if case == "sleep":
        loss = engine(torch.ones(2, width)).sum()
        if rank == 1:
            time.sleep(600)  # stuck in user code, inside a training step
        engine.backward(loss)
        engine.step()
    elif case == "pipe":
        stall["on"] = rank == 0
        engine.train_batch(batches)
    elif rank == 0:
        comm.reduce_scatter_tensor(torch.empty(2), torch.ones(4), group=None, label="stage2 grads")
    else:
        comm.all_gather_into_tensor(torch.empty(8), torch.ones(4), group=None, label="stage3 gather blocks.2")


if case == "sleep" and os.environ.get("HANG_AFTER_STEP"):  # one whole step first: the segment is set up
    engine.backward(engine(torch.ones(2, width)).sum())
    engine.step()
print(f"HANG-START {time.time()}", flush=True)
step()
print("not reached", flush=True)
'''


def _run(tmp_path, case, **extra):
    script = tmp_path / "hang.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, COMMS_TIMEOUT=str(TIMEOUT_S), HANG_CASE=case, OMP_NUM_THREADS="1", **extra)
    p = subprocess.run([DSLAUNCH, "--num_gpus", "2", "--master_port", "0", str(script)], capture_output=True,
                       text=True, timeout=150, env=env)
    ended = time.time()
    out = p.stdout + p.stderr
    starts = [float(x) for x in re.findall(r"HANG-START ([0-9.]+)", out)]
    assert len(starts) == 2, out[-3000:]
    return p.returncode, out, ended - max(starts)


def _rank_lines(out, rank):
    return "\n".join(line for line in out.splitlines() if line.startswith(f"[rank {rank}]"))


@pytest.mark.timeout(180)
def test_a_rank_asleep_in_a_step_ends_the_job_with_both_stacks(tmp_path):
    rc, out, after = _run(tmp_path, "sleep")
    assert rc == 124, out[-4000:]
    assert after < TIMEOUT_S + 10, f"the job ended {after:.1f} s after the hang began\n{out[-3000:]}"
    r0, r1 = _rank_lines(out, 0), _rank_lines(out, 1)
    assert "--- rank 0: Python stacks ---" in r0 and "--- rank 1: Python stacks ---" in r1
    assert "in step" in r1 and "time.sleep(600)" in r1  # where rank 1 is stuck
    # the engine's collectives, labelled: 2 initial broadcasts, 3 warm-ups, then the gradient bucket
    assert "all_reduce #6 on world (stage0 grads bucket 0): 80 bytes, in flight" in r0  # rank 0's flight record
    assert "broadcast #1 on world (initial weight): 64 bytes, done" in r1
    assert "all_reduce #5 on world (warm-up 2): 16 bytes, done" in r1
    assert re.search(r"ranks disagree: rank 1 is not in a collective \(last all_reduce #5 on world \(warm-up 2\), "
                     r"[0-9.]+ s ago; main thread at hang.py:\d+ in step\), rank 0 in all_reduce #6 on world "
                     r"\(stage0 grads bucket 0\) for [0-9.]+ s", out), out[-3000:]
    assert "dslaunch: rank 0 failed first" in out and "exit" in out.split("failed first", 1)[1].splitlines()[0]
    assert "not reached" not in out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("after_step", [False, True], ids=["setting-up", "set-up"])
def test_a_rank_asleep_while_the_other_waits_in_shared_memory(tmp_path, after_step):
    """The bucket is 64 KiB: its all-reduce goes through the group's shared segment
    (comm/shm.py), which the first such call sets up with the other rank (rank 1 never comes)
    or, after a whole step, waits on rank 1's counter in the kernel: the watchdog ends both."""
    extra = {"HANG_WIDTH": "128"}
    if after_step:
        extra["HANG_AFTER_STEP"] = "1"
    rc, out, after = _run(tmp_path, "sleep", **extra)
    assert rc == 124, out[-4000:]
    assert after < TIMEOUT_S + 10, f"the job ended {after:.1f} s after the hang began\n{out[-3000:]}"
    r0, r1 = _rank_lines(out, 0), _rank_lines(out, 1)
    assert "--- rank 0: Python stacks ---" in r0 and "--- rank 1: Python stacks ---" in r1
    assert "time.sleep(600)" in r1
    seq = 7 if after_step else 6  # a whole step first: its all_reduce
    assert re.search(rf"rank 0 in all_reduce #{seq} on world \(stage0 grads bucket 0\) for [0-9.]+ s", out), \
        out[-3000:]
    assert "not reached" not in out


@pytest.mark.timeout(180)
def test_ranks_in_different_collectives_are_named(tmp_path):
    rc, out, after = _run(tmp_path, "mismatch")
    assert rc == 124, out[-4000:]
    assert after < TIMEOUT_S + 10, f"the job ended {after:.1f} s after the hang began\n{out[-3000:]}"
    assert "--- rank 0: Python stacks ---" in out and "--- rank 1: Python stacks ---" in out
    pair = {r"rank 0 (is )?in reduce_scatter_tensor #4 on world \(stage2 grads\)",
            r"rank 1 (is )?in all_gather_into_tensor #4 on world \(stage3 gather blocks.2\)"}
    lines = [ln for ln in out.splitlines() if "ranks disagree" in ln]
    assert lines and all(re.search(p, lines[0]) for p in pair), out[-3000:]
    assert "not reached" not in out


@pytest.mark.timeout(180)
def test_a_pipeline_stage_waiting_in_recv_is_reported(tmp_path):
    rc, out, after = _run(tmp_path, "pipe")
    assert rc == 124, out[-4000:]
    assert after < TIMEOUT_S + 10, f"the job ended {after:.1f} s after the hang began\n{out[-3000:]}"
    r0, r1 = _rank_lines(out, 0), _rank_lines(out, 1)
    assert "--- rank 0: Python stacks ---" in r0 and "--- rank 1: Python stacks ---" in r1
    assert "time.sleep(600)" in r0 and "recv_activation" in r1  # where each stage is
    assert re.search(r"rank 1: recv #\d+ on world \(activation shapes\).* did not finish within", r1), r1[-3000:]
    assert re.search(r"ranks disagree: rank 0 is not in a collective \(last .*main thread at hang.py:\d+ in "
                     r"forward\), rank 1 in recv #\d+ on world \(activation shapes\)", out), out[-3000:]
    assert "not reached" not in out


def test_sequence_numbers_count_per_group_and_the_mismatch_line():
    from dslaunch.runtime.comm.flight import FlightRecorder, RankReport, explain

    rec = FlightRecorder(depth=4)
    for op in ("all_reduce", "all_gather", "all_reduce"):
        rec.end(rec.begin(op, None, "world", 16, "w"))
    rec.end(rec.begin("all_reduce", 7, "dp 0", 8, ""))
    pending = rec.begin("reduce_scatter", None, "world", 64, "stage2 grads")
    assert [(e.op, e.seq) for e in rec.entries()] == [("all_gather", 2), ("all_reduce", 3), ("all_reduce", 1),
                                                      ("reduce_scatter", 4)]  # depth 4: the oldest fell out
    assert rec.oldest_pending() is pending and rec.last_finished().group == "dp 0"

    me = RankReport.of(0, rec, "train.py:10 in step")
    other = RankReport(1, {"op": "all_gather", "seq": 4, "group": "world", "label": "stage3 gather blocks.2",
                           "age_s": 5.0}, None, "x.py:1 in f")
    line = explain({0: me, 1: other}, 3)
    assert line.startswith("ranks disagree: rank 0 is in reduce_scatter #4 on world (stage2 grads) for ")
    assert ", rank 1 in all_gather #4 on world (stage3 gather blocks.2) for 5.0 s" in line
    assert line.endswith("rank 2 did not answer (dead, or blocked outside Python)")
    # all in the same collective: nobody disagrees, the missing rank is the story
    same = RankReport(1, dict(me.current), None, "y.py:2 in g")
    assert not explain({0: me, 1: same}, 2).startswith("ranks disagree")
