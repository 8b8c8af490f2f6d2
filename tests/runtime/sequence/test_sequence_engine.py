"""Ulysses sequence parallelism through initialize: `sequence_parallel_size`.

A tiny causal attention network (tests/sp_workload.py) using DistributedAttention trains
at sp=2, sp=4, sp=2 with ZeRO-2 and -3, and sp=2 x dp=2; its losses, and its weights at the end,
must equal one process training over the whole sequence on the same global batch, to 1e-5
in fp32, with gradient clipping at 1.0 (the global norm must count sequence ranks once).
SGD makes the weights a strict check of the gradients (averaged over data x sequence
ranks); under AdamW only the losses are compared, because the key projection's bias has a
gradient that is zero but for rounding (softmax ignores a shift shared by all keys) and Adam
turns rounding of a different summation order into steps of size lr. Real DeepSpeed's
losses (tests/data/ds_sequence/, AdamW and SGD) must equal ours. The batch rule counts data-parallel ranks only;
bad input is one line.
"""
import functools
import json
import os

import pytest

from dist_harness import run_function
import repo_paths

HERE = str(repo_paths.TESTS)
FIXTURE = os.path.join(HERE, "data", "ds_sequence", "expected.json")


def train_body(cases):
    """Train each (sp, micro, stage, optimizer) case in turn in these processes (every case
    builds its own engine and mesh); return [(losses, weights)] in case order."""
    import dslaunch.runtime as deepspeed
    import sp_workload
    from dslaunch.runtime import comm
    from dslaunch.runtime.sequence import DistributedAttention

    out = []
    for sp, micro, stage, optimizer in cases:
        losses, weights = sp_workload.train(deepspeed, DistributedAttention, sp, micro, stage=stage,
                                            optimizer=optimizer)
        out.append((losses, weights, comm.get_world_size() // sp))
    return out


@functools.lru_cache(maxsize=None)
def _one_process(micro, optimizer):
    # in a process of its own: the engine starts a process group, which must not outlive
    # the run inside pytest's process (later tests there use fake groups)
    return run_function(train_body, nprocs=1, timeout=240, env={"PYTHONPATH": HERE},
                        kwargs=dict(cases=[(1, micro, 0, optimizer)]))[0][0]


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def _check(results, cases, expected=None):
    for rank, per_case in enumerate(results):
        for (sp, micro, stage, optimizer), (losses, weights, dp) in zip(cases, per_case):
            ref_losses, ref_weights, _ = _one_process(micro * dp, optimizer)
            what = (rank, sp, dp, stage, optimizer)
            assert _close(losses, ref_losses), (what, losses, ref_losses)
            if optimizer == "sgd" and stage < 3:  # see the module docstring; ZeRO-3 keeps shards
                assert _close(weights, ref_weights), what
            if expected is not None and (sp, stage, optimizer) in expected:
                want = expected[(sp, stage, optimizer)]
                assert _close(losses, want), ("DeepSpeed", what, losses, want)


def sp2_body(cases, tmp):
    return train_body(cases), refusal_body([extra for extra, _ in BAD], tmp)


def test_sp2_and_zero2_equal_one_process_and_deepspeed(tmp_path):
    """sp=2 (ZeRO 0, 2 and 3; SGD, where a wrong gradient scale shows, and AdamW) equals one
    process over the whole sequence, and real DeepSpeed 0.19.8's losses
    (scripts/make_ds_sp_fixtures.py)."""
    fixture = json.load(open(FIXTURE))
    expected = {(c["sp"], c["stage"], c["optimizer"]): c["losses"] for c in fixture.values()}
    assert _close(_one_process(2, "adamw")[0], expected[(1, 0, "adamw")])  # the same network under both
    assert _close(_one_process(2, "sgd")[0], expected[(1, 0, "sgd")])
    cases = [(2, 2, 0, "sgd"), (2, 2, 2, "sgd"), (2, 2, 3, "sgd"), (2, 2, 0, "adamw"), (2, 2, 2, "adamw")]
    results = run_function(sp2_body, nprocs=2, timeout=240, env={"PYTHONPATH": HERE},
                           kwargs=dict(cases=cases, tmp=str(tmp_path)))
    _check([r[0] for r in results], cases, expected)
    # and, in the same processes, bad input: one line each
    messages = [m for _, m in BAD] + ["save_checkpoint: checkpoints with sequence_parallel_size 2 are not supported"]
    for _, refusals in results:
        for text, message in zip(refusals, messages):
            assert text is not None and message in text and "\n" not in text, (text, message)


def test_sp4_and_sp2_x_dp2_equal_one_process():
    """4 ranks: sp=4, then sp=2 x dp=2 with ZeRO-1 (each data rank its own rows)."""
    cases = [(4, 2, 0, "sgd"), (2, 2, 1, "sgd")]
    results = run_function(train_body, nprocs=4, timeout=300, env={"PYTHONPATH": HERE}, kwargs=dict(cases=cases))
    assert [dp for _, _, dp in results[0]] == [1, 2]
    _check(results, cases)


def mesh_param_body():
    """sp=2 x dp=2 from DeepSpeed's initialize(mesh_param=(2, 2)) alone (the config names no
    sequence size), then what a config that disagrees with mesh_param says."""
    import torch

    import dslaunch.runtime as deepspeed
    import sp_workload
    from dslaunch.runtime.sequence import DistributedAttention
    from dslaunch.runtime.strict import ConfigError

    losses, weights = sp_workload.train(deepspeed, DistributedAttention, 2, 2, stage=1, optimizer="sgd",
                                        init_kwargs={"mesh_param": (2, 2)}, sp_key=False)
    refusals = []
    for extra in ({"sequence_parallel_size": 4}, {"data_parallel_size": 1}):
        net = torch.nn.Linear(2, 2)
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, **extra}
        try:
            deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg, mesh_param=(2, 2))
            refusals.append(None)
        except ConfigError as exc:
            refusals.append(str(exc))
    return (losses, weights, 2), refusals


def test_mesh_param_builds_the_sequence_mesh():
    """DeepSpeed's initialize(mesh_param=(dp, sp)) gives the data x sequence mesh that
    sequence_parallel_size gives, with gradients averaged over both axes (where DeepSpeed
    0.19.8 reduces them over the data group alone and its sequence ranks drift apart)."""
    results = run_function(mesh_param_body, nprocs=4, timeout=300, env={"PYTHONPATH": HERE})
    _check([[trained] for trained, _ in results], [(2, 2, 1, "sgd")])
    for _, refusals in results:
        assert refusals == ["config: sequence_parallel_size: 4 but initialize(mesh_param=(2, 2)) gives 2; set one of "
                            "the two",
                            "config: data_parallel_size: 1 but initialize(mesh_param=(2, 2)) gives 2; set one of the "
                            "two"], refusals


def tp_sp_body(cases):
    """Each (tp, sp, micro, stage, optimizer) case on the tiny network whose q, k, v and o
    projections tensor parallelism shards by heads (sp_workload.make_tp_net); tp=1, sp=1 is
    one process over the whole, unsharded network."""
    import dslaunch.runtime as deepspeed
    import sp_workload
    from dslaunch.runtime.sequence import DistributedAttention

    out = []
    for tp, sp, micro, stage, optimizer in cases:
        out.append(sp_workload.train(deepspeed, DistributedAttention, sp, micro, stage=stage, optimizer=optimizer,
                                     tp=tp, net=sp_workload.make_tp_net()))
    return out


def test_tp2_x_sp2_equals_one_process():
    """4 ranks, tensor 2 x sequence 2 on one mesh: TP shards the heads, Ulysses splits each
    tensor rank's heads over its sequence group; ZeRO 0 and 2 (sharded over data x
    sequence), SGD (the reassembled weights check every gradient, clipped at 1.0: the norm
    counts tensor slices once and sequence ranks once) and AdamW. Equal to one process over
    the whole sequence and the unsharded network."""
    cases = [(2, 2, 2, 0, "sgd"), (2, 2, 2, 2, "sgd"), (2, 2, 2, 0, "adamw")]
    refs = run_function(tp_sp_body, nprocs=1, timeout=240, env={"PYTHONPATH": HERE},
                        kwargs=dict(cases=[(1, 1, 2, 0, "sgd"), (1, 1, 2, 0, "adamw")]))[0]
    ref = {"sgd": refs[0], "adamw": refs[1]}
    results = run_function(tp_sp_body, nprocs=4, timeout=300, env={"PYTHONPATH": HERE}, kwargs=dict(cases=cases))
    for rank, per_case in enumerate(results):
        for (tp, sp, micro, stage, optimizer), (losses, weights) in zip(cases, per_case):
            ref_losses, ref_weights = ref[optimizer]
            what = (rank, tp, sp, stage, optimizer)
            assert _close(losses, ref_losses), (what, losses, ref_losses)
            if optimizer == "sgd":
                assert _close(weights, ref_weights), what


BAD = [
    ({"sequence_parallel_size": 3}, "sequence 3 does not divide world 2"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size: must be > 0"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}},
     "pipe 1 x sequence 2 x tensor 2 = 4 does not divide world 2"),
    ({"sequence_parallel_size": 2, "data_parallel_size": 2},
     "data_parallel_size: 2 but 2 ranks laid out as data=1 x sequence=2 leave 1 data-parallel ranks"),
]


def refusal_body(bad, tmp):
    """Each bad config's error line, then what save_checkpoint says at sp=2."""
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.strict import ConfigError

    def make(extra):
        net = torch.nn.Linear(2, 2)
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
        cfg.update(extra)
        return deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)[0]

    out = []
    for extra in bad:
        try:
            make(extra)
            out.append(None)
        except ConfigError as exc:
            out.append(str(exc))
    engine = make({"sequence_parallel_size": 2})
    assert engine.train_batch_size() == 1  # one data-parallel rank: the sequence pair shares a batch
    try:
        engine.save_checkpoint(tmp)
        out.append(None)
    except CheckpointError as exc:
        out.append(str(exc))
    return out


def test_bench_sp_sweep_runs_and_halves_activations_at_sp_2():
    """scripts/bench_sp.py's sp sweep (our side; DeepSpeed's is the same code under its Python):
    it runs, and rank 0's activations at sp 2 are about half of sp 1's."""
    import subprocess
    import sys

    root = str(repo_paths.ROOT)
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_sp.py"), "--sp", "1", "2", "--seq", "64",
                          "--hidden", "32", "--heads", "4", "--layers", "1", "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.strip().startswith("64 ")]
    assert [r[1] for r in rows] == ["1", "2"], out.stdout
    assert 0.45 < float(rows[1][5]) < 0.6, out.stdout  # activations x sp1
