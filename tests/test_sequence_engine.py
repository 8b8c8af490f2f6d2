"""Ulysses sequence parallelism through initialize: `sequence_parallel_size`.

A tiny causal attention network (tests/sp_workload.py) using DistributedAttention trains
at sp=2, sp=4, sp=2 with ZeRO-2 and sp=2 x dp=2; its losses, and its weights at the end,
must equal one process training over the whole sequence on the same global batch, to 1e-5
in fp32. SGD makes the weights a strict check of the gradients (averaged over data x
sequence ranks); AdamW is what the DeepSpeed fixture (tests/data/ds_sequence/) records, and
real DeepSpeed's losses must equal ours. The batch rule counts data-parallel ranks only;
bad input is one line.
"""
import json
import os

import pytest

from dist_harness import RankFailed, run_function

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "data", "ds_sequence", "expected.json")


def train_body(sp=1, micro=2, stage=0, optimizer="sgd", dp_expected=None):
    import dslaunch.runtime as deepspeed
    import sp_workload
    from dslaunch.runtime.sequence import DistributedAttention

    out = sp_workload.train(deepspeed, DistributedAttention, sp, micro, stage=stage, optimizer=optimizer)
    if dp_expected is not None:
        from dslaunch.runtime import comm

        assert comm.get_world_size() // sp == dp_expected
    return out


def _one_process(micro, optimizer="sgd"):
    import sys

    sys.path.insert(0, HERE)
    return train_body(sp=1, micro=micro, optimizer=optimizer)


def _close(a, b, tol=1e-5):
    return max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.mark.parametrize("nprocs,sp,stage", [pytest.param(2, 2, 0, id="sp2"), pytest.param(4, 4, 0, id="sp4"),
                                             pytest.param(2, 2, 2, id="sp2-zero2"),
                                             pytest.param(4, 2, 1, id="sp2xdp2-zero1")])
def test_sequence_parallel_training_equals_one_process(nprocs, sp, stage):
    dp = nprocs // sp
    ref_losses, ref_weights = _one_process(micro=2 * dp)
    results = run_function(train_body, nprocs=nprocs, timeout=240, env={"PYTHONPATH": HERE},
                           kwargs=dict(sp=sp, micro=2, stage=stage, dp_expected=dp))
    for rank, (losses, weights) in enumerate(results):
        assert _close(losses, ref_losses), (rank, losses, ref_losses)
        assert _close(weights, ref_weights), rank


def test_losses_equal_real_deepspeed():
    """scripts/make_ds_sp_fixtures.py ran the same workload under DeepSpeed 0.19.8 (AdamW,
    sp=2 and sp=2 with ZeRO-2); our losses equal DeepSpeed's and one process's."""
    expected = json.load(open(FIXTURE))
    ref_losses, _ = _one_process(micro=2, optimizer="adamw")
    assert _close(expected["sp1"]["losses"], ref_losses)
    for case in ("sp2", "sp2_zero2"):
        want = expected[case]
        results = run_function(train_body, nprocs=2, timeout=240, env={"PYTHONPATH": HERE},
                               kwargs=dict(sp=want["sp"], micro=2, stage=want["stage"], optimizer="adamw"))
        assert _close(results[0][0], want["losses"]), (case, results[0][0], want["losses"])
        assert _close(results[0][0], ref_losses), case


def refusal_body(cfg_extra):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.strict import ConfigError

    net = torch.nn.Linear(2, 2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    cfg.update(cfg_extra)
    try:
        deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("extra,message", [
    ({"sequence_parallel_size": 3}, "sequence 3 does not divide world 2"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size: must be > 0"),
    ({"sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}},
     "sequence_parallel_size 2 with tensor_parallel.autotp_size 2 is not supported"),
])
def test_bad_sequence_parallel_size_is_one_line(extra, message):
    results = run_function(refusal_body, nprocs=2, timeout=120, kwargs=dict(cfg_extra=extra))
    for text in results:
        assert text is not None and message in text and "\n" not in text, text


def checkpoint_body(tmp):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint import CheckpointError

    net = torch.nn.Linear(2, 2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    assert engine.train_batch_size() == 1  # one data-parallel rank: the sequence pair shares a batch
    try:
        engine.save_checkpoint(tmp)
    except CheckpointError as exc:
        return str(exc)


def test_checkpoint_with_sequence_parallelism_is_refused(tmp_path):
    results = run_function(checkpoint_body, nprocs=2, timeout=120, kwargs=dict(tmp=str(tmp_path)))
    assert all("checkpoints with sequence_parallel_size 2 are not supported" in r for r in results), results
