"""MoE checkpoints in DeepSpeed's layout (runtime/train/checkpoint/moe.py), resumed at other
expert-parallel and world sizes, consolidated, and read from real DeepSpeed 0.19.8.

The training script is scripts/make_ds_moe_fixtures.py's `train` (tests/runtime/moe/test_moe_training.py
has the model); checkpoints are saved after 2 of its 4 steps. One launch per world size:

    2 ranks: ep 2 at ZeRO 0 and 2 saves (DeepSpeed's file names); resumed at ep 2, the
             losses are the uninterrupted run's; DeepSpeed's own ep 2 checkpoints
             (tests/data/ds_moe/ckpt_*) resume with DeepSpeed's subsequent losses (1e-5)
    4 ranks: ep 2 x expert-data 2, ZeRO 1, saves; resumed at ep 1 (ZeRO 1) for one step,
             saved again and resumed at ep 4 (ZeRO 2): the uninterrupted losses
    1 rank:  the 2- and 4-rank checkpoints, ours and DeepSpeed's, resume in one process
             holding all experts (ep 1, the per-rank batches as micro-batches) with the
             uninterrupted losses; `dslaunch consolidate` / zero_to_fp32 give one full model;
             what is refused is one line
"""
import json
import os

import pytest

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
fx = load_script("make_ds_moe_fixtures")
DATA = os.path.join(ROOT, "tests", "data", "ds_moe")
EXPECTED = json.load(open(os.path.join(DATA, "expected.json")))
TOL = 1e-5
AT = fx.SAVE_AT


def _job(world, ep, stage, gas=1):
    return dict(world=world, ep=ep, stage=stage, k=1, gas=gas)


def _two(tmp):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.moe import layer

    rank = dist.get_rank()
    out = {}
    for stage in (0, 2):
        folder = os.path.join(tmp, f"w2_s{stage}")
        job = _job(2, 2, stage)
        out[f"whole_s{stage}"] = fx.train(deepspeed, layer, job, rank, save_dir=folder)["losses"]
        out[f"resumed_s{stage}"] = fx.train(deepspeed, layer, job, rank, load_dir=folder)["losses"]
        if rank == 0:
            out[f"files_s{stage}"] = sorted(os.listdir(os.path.join(folder, f"global_step{AT}")))
        ds = os.path.join(DATA, f"ckpt_ep2_w2_s{stage}")
        out[f"ds_s{stage}"] = fx.train(deepspeed, layer, job, rank, load_dir=ds)["losses"]
    return out


def _four(tmp):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.moe import layer

    rank = dist.get_rank()
    a, c = os.path.join(tmp, "w4_ep2"), os.path.join(tmp, "w4_ep1")
    return {"whole": fx.train(deepspeed, layer, _job(4, 2, 1), rank, save_dir=a)["losses"],
            "ep1": fx.train(deepspeed, layer, _job(4, 1, 1), rank, load_dir=a, save_dir=c, save_at=AT + 1)["losses"],
            "ep4": fx.train(deepspeed, layer, _job(4, 4, 2), rank, load_dir=c)["losses"]}


def _one(tmp):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint.consolidate import consolidate_checkpoint
    from dslaunch.runtime.checkpoint.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from dslaunch.runtime.moe import layer

    out = {}
    for name, folder, gas, stage in (("w2_s0", "w2_s0", 2, 0), ("w2_s2", "w2_s2", 2, 2), ("w4", "w4_ep2", 4, 0)):
        out[name] = fx.train(deepspeed, layer, _job(1, 1, stage, gas), 0, load_dir=os.path.join(tmp, folder))["losses"]
    # DeepSpeed's ep 2 checkpoints in one process holding every expert: DeepSpeed's losses
    for stage in (0, 2):
        out[f"ds_s{stage}"] = fx.train(deepspeed, layer, _job(1, 1, stage, 2), 0,
                                       load_dir=os.path.join(DATA, f"ckpt_ep2_w2_s{stage}"))["losses"]
    out["errors"] = _errors(deepspeed, layer, tmp)
    # consolidation: the full model equals what one process holding every expert loads
    for name, folder in (("w2_s2", os.path.join(tmp, "w2_s2")), ("w4", os.path.join(tmp, "w4_ep2")),
                         ("ds_s0", os.path.join(DATA, "ckpt_ep2_w2_s0")), ("ds_s2", os.path.join(DATA, "ckpt_ep2_w2_s2"))):
        model = fx.make_model(layer, 1, 0, 1)
        engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=fx.config(_job(1, 1, 0, 2)))[0]
        engine.load_checkpoint(folder)
        want = engine.module.state_dict()
        for how, got in (("consolidate", consolidate_checkpoint(folder)),
                         ("zero_to_fp32", get_fp32_state_dict_from_zero_checkpoint(folder))):
            out[f"{how}_{name}"] = sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    return out


def _errors(deepspeed, layer, tmp):
    """One line each: another expert count; a model that is itself the MoE layer."""
    import torch

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = layer.MoE(fx.H, torch.nn.Linear(fx.H, fx.H), num_experts=2)

    def attempt(model, action):
        engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=fx.config(_job(1, 1, 0, 2)))[0]
        try:
            action(engine)
        except deepspeed.CheckpointError as exc:
            return str(exc)
        return None

    return {"experts": attempt(Two(), lambda e: e.load_checkpoint(os.path.join(tmp, "w2_s0"))),
            "root": attempt(layer.MoE(fx.H, torch.nn.Linear(fx.H, fx.H), num_experts=2),
                            lambda e: e.save_checkpoint(os.path.join(tmp, "root")))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("moe_ckpt"))
    return {w: run_function(fn, nprocs=w, kwargs={"tmp": tmp}, timeout=240)[0]
            for w, fn in ((2, _two), (4, _four), (1, _one))}


@pytest.mark.timeout(600)
def test_deepspeed_layout_and_resume_at_the_same_expert_parallel_size(runs):
    two = runs[2]
    for stage in (0, 2):
        assert two[f"whole_s{stage}"] == pytest.approx(EXPECTED[f"ep2_w2_s{stage}"]["losses"], abs=TOL)
        assert two[f"resumed_s{stage}"] == pytest.approx(two[f"whole_s{stage}"][AT:], abs=TOL)
    experts = [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(4)]
    assert set(experts + ["expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt",
                          "mp_rank_00_model_states.pt"]) <= set(two["files_s0"])
    assert set(experts + ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                          "mp_rank_00_model_states.pt", "manifest.json"]) <= set(two["files_s2"])
    # DeepSpeed's engine._get_optimizer_ckpt_name names the expert ranks' optimizer files as written
    from dslaunch.runtime.train.engine import DeepSpeedEngine
    named = {DeepSpeedEngine._get_optimizer_ckpt_name(None, "/ck", f"global_step{AT}", r) for r in (0, 1)}
    assert named == {f"/ck/global_step{AT}/expp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}
    assert {os.path.basename(n) for n in named} <= set(two["files_s0"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_checkpoint_resumes_with_deepspeeds_losses(runs, stage):
    assert runs[2][f"ds_s{stage}"] == pytest.approx(EXPECTED[f"ckpt_ep2_w2_s{stage}"]["losses"], abs=TOL)


@pytest.mark.timeout(600)
def test_resume_at_expert_parallel_2_then_1_then_4(runs):
    four = runs[4]
    assert four["whole"] == pytest.approx(EXPECTED["ep2_w4_s1"]["losses"], abs=TOL)
    assert four["ep1"] == pytest.approx(four["whole"][AT:], abs=TOL)
    assert four["ep4"] == pytest.approx(four["whole"][AT + 1:], abs=TOL)


@pytest.mark.timeout(600)
def test_resume_in_one_process_holding_every_expert(runs):
    one = runs[1]
    assert one["w2_s0"] == pytest.approx(runs[2]["whole_s0"][AT:], abs=TOL)
    assert one["w2_s2"] == pytest.approx(runs[2]["whole_s2"][AT:], abs=TOL)
    assert one["w4"] == pytest.approx(runs[4]["whole"][AT:], abs=TOL)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["consolidate", "zero_to_fp32"])
@pytest.mark.parametrize("name", ["w2_s2", "w4", "ds_s0", "ds_s2"])
def test_consolidated_full_model(runs, how, name):
    assert runs[1][f"{how}_{name}"] is True


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [0, 2])
def test_deepspeed_checkpoint_resumes_in_one_process_holding_every_expert(runs, stage):
    assert runs[1][f"ds_s{stage}"] == pytest.approx(EXPECTED[f"ckpt_ep2_w2_s{stage}"]["losses"], abs=TOL)


@pytest.mark.timeout(600)
def test_what_moe_checkpoints_refuse_is_one_line(runs):
    got = runs[1]["errors"]
    assert got["experts"].startswith("checkpoint ") and got["experts"].endswith(
        "w2_s0/global_step2: its MoE layers have [4] experts, this model's [2]"), got
    assert got["root"].startswith("save_checkpoint: the model itself is an MoE layer; wrap it in a module"), got
    assert all("\n" not in v for v in got.values())
