"""The ZeRO names DeepSpeed's unit tests import, against DeepSpeed 0.19.8's recorded answers
(tests/data/ds_offload_states.json, by scripts/make_ds_offload_states_fixtures.py over
scripts/offload_states_cases.py):

- which states engine.offload_states moves for an include list, per stage and with
  offload_optimizer (whose masters and state, and at stage 3 gradients, stay in host memory);
- zero.Init's check that a one-rank process group does not contradict the launcher's
  WORLD_SIZE (deepspeed.runtime.zero.partition_parameters._contradicting_single_rank_pg_error),
  and zero.Init itself stopping on it in one line;
- CUDAQuantizer: DeepSpeed's block count and fp16 reading, its values back in the asked dtype;
- unwrap_model_for_generation: the model whole and hook-free inside, training unchanged after.
"""
import json
import sys

import pytest
import torch

from dist_harness import run_function
from repo_paths import DATA, SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import offload_states_cases as cases  # noqa: E402

import dslaunch.runtime  # noqa: E402,F401  (puts DeepSpeed's module paths in place)
from dslaunch.runtime.zero.offload_states import resolve_include  # noqa: E402
from dslaunch.runtime.zero.partition_parameters import (CUDAQuantizer,  # noqa: E402
                                                        _contradicting_single_rank_pg_error)

DS = json.loads((DATA / "ds_offload_states.json").read_text())


def test_every_case_has_deepspeeds_answer_on_record():
    assert DS["deepspeed"] == "0.19.8"
    assert set(DS["include"]) == set(cases.INCLUDE_CASES) and set(DS["pg"]) == set(cases.PG_CASES)
    assert set(DS["quantizer"]) == {str(n) for n in cases.QUANTIZER_NUMELS}


@pytest.mark.parametrize("name", sorted(cases.INCLUDE_CASES))
def test_offload_moves_the_states_deepspeed_moves(name):
    stage, host, include = cases.INCLUDE_CASES[name]
    assert [k.value for k in resolve_include(include, host, stage)] == DS["include"][name]


@pytest.mark.parametrize("name", sorted(cases.PG_CASES))
def test_one_rank_group_check_answers_as_deepspeed(name):
    world, explicit, env = cases.PG_CASES[name]
    msg = _contradicting_single_rank_pg_error(dp_world_size=world, explicit_process_group=object() if explicit
                                              else None, env=env)
    want = DS["pg"][name]
    if want is None:
        assert msg is None
    else:
        assert f"WORLD_SIZE={want['world_size_named']}" in msg and "init_distributed" in msg
        assert "\n" not in msg


def _init_under_a_one_rank_group():
    import os

    import torch

    import dslaunch.runtime as deepspeed

    os.environ["WORLD_SIZE"] = "4"  # as a launcher of 4 would have set it; the group has 1 rank
    out = {}
    try:
        with deepspeed.zero.Init():
            torch.nn.Linear(4, 4)
        out["default"] = None
    except RuntimeError as e:
        out["default"] = str(e)
    with deepspeed.zero.Init(data_parallel_group=torch.distributed.new_group([0])):
        layer = torch.nn.Linear(4, 4)  # a group the script chose is taken as meant
    out["explicit"] = tuple(layer.weight.ds_shape)
    return out


def test_zero_init_stops_on_a_group_contradicting_the_launcher():
    out = run_function(_init_under_a_one_rank_group, nprocs=1, timeout=300)[0]
    assert "WORLD_SIZE=4" in out["default"] and "\n" not in out["default"]
    assert out["explicit"] == (4, 4)


@pytest.mark.parametrize("n", cases.QUANTIZER_NUMELS)
def test_quantizer_blocks_as_deepspeed(n, monkeypatch):
    op = cases.RecordingQuantizerOp()
    monkeypatch.setattr(CUDAQuantizer, "quantizer_cuda_module", op)
    CUDAQuantizer().quantize(torch.ones(n, dtype=torch.bfloat16))
    assert op.calls == [DS["quantizer"][str(n)]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantizer_round_trips_in_the_parameters_dtype(dtype):
    x = torch.linspace(-3, 3, 4096, dtype=dtype)
    q, scale = CUDAQuantizer().quantize(x)
    assert q.dtype == torch.int8 and scale.numel() == DS["quantizer"]["4096"]["groups"]
    back = CUDAQuantizer().dequantize(q, scale, dtype=dtype)
    assert back.dtype == dtype
    assert (back.float() - x.float()).abs().max() <= 3 / 127 + 1e-2  # one 8-bit step of the block's range
    assert CUDAQuantizer().dequantize(q, scale).dtype == torch.float16  # no dtype: the op's fp16


def _generation(use_unwrap):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero import unwrap_model_for_generation

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    torch.manual_seed(1 + torch.distributed.get_rank())
    losses, inside = [], {}
    for step in range(4):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        if step == 1 and use_unwrap:
            gathers = []
            real = deepspeed.comm.all_gather_into_tensor
            with unwrap_model_for_generation(engine) as unwrapped:
                deepspeed.comm.all_gather_into_tensor = lambda *a, **k: gathers.append(1) or real(*a, **k)
                with torch.no_grad():
                    y = torch.ones(1, 8)
                    for _ in range(3):  # a generation loop: whole weights, no gathers
                        y = unwrapped(y)
                deepspeed.comm.all_gather_into_tensor = real
                inside = {"whole": [tuple(p.shape) for p in model.parameters()], "gathers": len(gathers),
                          "same_engine": unwrapped is engine, "y": y.tolist(),
                          "hooks": sum(len(m._forward_pre_hooks) for m in model.modules())}
            inside["at_rest_after"] = [p.numel() for p in model.parameters()]
            inside["hooks_after"] = sum(len(m._forward_pre_hooks) for m in model.modules())
    return losses, inside


def _both():
    return _generation(False), _generation(True)


def test_unwrap_for_generation_gathers_once_and_leaves_training_unchanged():
    (ref, _), (got, inside) = run_function(_both, nprocs=2, timeout=300)[0]
    assert got == ref  # bit-identical losses after the generation context
    assert inside["same_engine"] and inside["gathers"] == 0
    assert inside["hooks"] == 0 and inside["hooks_after"] > 0  # the ZeRO hooks are off inside, back after
    assert inside["whole"] == [(16, 8), (16,), (8, 16), (8,)]
    assert inside["at_rest_after"] == [0, 0, 0, 0]  # partitioned again
