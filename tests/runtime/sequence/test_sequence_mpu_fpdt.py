"""DeepSpeed's sequence-parallel mpu module (`deepspeed.runtime.sequence_parallel.parallel_state_sp`,
runtime/sequence/parallel_state_sp.py) and FPDT's input layout (`deepspeed.sequence.fpdt_layer`,
runtime/sequence/fpdt.py).

The mpu is checked the way DeepSpeed's own Ulysses fixture was made (scripts/make_ds_sp_fixtures.py
hands DeepSpeed's parallel_state_sp to initialize as the mpu): the same tiny network trained
with ours as the mpu gives DeepSpeed 0.19.8's recorded losses. The layout is compared with
DeepSpeed's own outputs (scripts/make_ds_fpdt_fixtures.py).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import repo_paths
from dist_harness import run_function

HERE = str(repo_paths.TESTS)


def _close(a, b, tol=1e-5):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def mpu_body():
    import dslaunch.runtime as deepspeed
    import sp_workload
    from dslaunch.runtime import comm
    from dslaunch.runtime.sequence import DistributedAttention, parallel_state_sp as sp_mpu

    errors = []
    for call in (lambda: sp_mpu.get_sequence_parallel_group(), lambda: sp_mpu.initialize_sequence_parallel(1),
                 lambda: sp_mpu.initialize_sequence_parallel(3)):
        try:
            call()
            errors.append(None)
        except (RuntimeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    sp_mpu.initialize_sequence_parallel(2)
    try:
        sp_mpu.initialize_sequence_parallel(2)
        errors.append(None)
    except RuntimeError as exc:
        errors.append(f"RuntimeError: {exc}")
    answers = {
        "sp": (sp_mpu.get_sequence_parallel_rank(), sp_mpu.get_sequence_parallel_world_size()),
        "sdp": (sp_mpu.get_sequence_data_parallel_rank(), sp_mpu.get_sequence_data_parallel_world_size()),
        "mp": (sp_mpu.get_model_parallel_rank(), sp_mpu.get_model_parallel_world_size()),
        "sp_ranks": comm.get_all_ranks_from_group(sp_mpu.get_sequence_parallel_group()),
    }
    losses, _ = sp_workload.train(deepspeed, DistributedAttention, 2, 2, optimizer="sgd",
                                  init_kwargs={"mpu": sp_mpu})
    sp_mpu.release()
    answers["released"] = sp_mpu._State.sequence is None
    return answers, errors, losses


def test_parallel_state_sp_as_mpu_trains_as_deepspeed():
    expected = json.load(open(os.path.join(HERE, "data", "ds_sequence", "expected.json")))["sp2_sgd"]["losses"]
    results = run_function(mpu_body, nprocs=2, timeout=240, env={"PYTHONPATH": HERE})
    for rank, (answers, errors, losses) in enumerate(results):
        assert answers["sp"] == (rank, 2) and answers["sdp"] == (rank, 2) and answers["mp"] == (rank, 2)
        assert answers["sp_ranks"] == [0, 1] and answers["released"]
        assert errors[0] == "RuntimeError: sequence parallel group is not initialized (call " \
                            "initialize_sequence_parallel first)"
        assert errors[1] == "ValueError: sequence_parallel_size must be greater than 1, got 1"
        assert errors[2] == "RuntimeError: world_size (2) is less than sequence_parallel_size 3"
        assert errors[3].startswith("RuntimeError: initialize_sequence_parallel: the sequence parallel groups are "
                                    "already initialized")
        assert _close(losses, expected), (rank, losses, expected)


def test_sequence_blocks_cut_the_world_in_consecutive_groups():
    from dslaunch.runtime.sequence.parallel_state_sp import sequence_blocks

    assert sequence_blocks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sequence_blocks(4, 2) == [[0, 1], [2, 3]]


def _fixture_cases():
    return json.load(open(os.path.join(HERE, "data", "ds_fpdt", "expected.json")))["cases"]


def _inputs(seq, batch):
    tokens = torch.arange(batch * seq).reshape(batch, seq)
    return tokens, tokens + 1000, tokens % 3, torch.ones(batch, 1, seq, seq).tril().long(), tokens * 2


@pytest.mark.parametrize("case", _fixture_cases(), ids=lambda c: f"seq{c['seq']}-sp{c['sp']}-chunk{c['chunk']}")
def test_fpdt_input_layout_equals_deepspeed(case):
    from dslaunch.runtime.sequence.fpdt import FPDT_InputConstruct

    args = type("Args", (), {"ds_sequence_parallel_fpdt_chunk_size": case["chunk"]})()
    for rank, want in enumerate(case["ranks"]):
        got = FPDT_InputConstruct(*_inputs(case["seq"], case["batch"]), args, case["sp"], rank).generate()
        assert [t.tolist() for t in got] == want, rank


def test_fpdt_layout_of_missing_tensors_and_bad_sizes():
    from dslaunch.runtime.sequence.fpdt import FPDT_InputConstruct, FPDTLayoutError

    args = type("Args", (), {"ds_sequence_parallel_fpdt_chunk_size": 8})()
    tokens = torch.arange(32)[None]
    out = FPDT_InputConstruct(tokens, None, None, None, None, args, 2, 1).generate()
    assert out[0].tolist() == [[4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]]
    assert out[1:] == (None, None, None, None)
    with pytest.raises(FPDTLayoutError, match="sequence length 30 must divide"):
        FPDT_InputConstruct(torch.arange(30)[None], None, None, None, None, args, 2, 0)


def test_fpdt_attention_kernels_refuse_in_one_line():
    from dslaunch.runtime.sequence import fpdt

    for call in (lambda: fpdt._FPDTGPUOffloadingAttentionImpl_.apply(torch.zeros(2)),
                 lambda: fpdt._FPDTGPUAttentionImpl_.apply(torch.zeros(2)), lambda: fpdt.FPDT_Attention()):
        with pytest.raises(NotImplementedError) as info:
            call()
        assert "not provided by dslaunch" in str(info.value) and "\n" not in str(info.value)
