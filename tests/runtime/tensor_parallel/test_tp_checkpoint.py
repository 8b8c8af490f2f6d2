"""Tensor-parallel checkpoints: saved in DeepSpeed's layout (one mp_rank_XX file per tensor
rank, ZeRO shards per data and tensor rank), resumed at another tensor size and ZeRO stage
(tp 2 -> 1 -> 4), with the losses of an uninterrupted run; and consolidated into the full
model. The model is a tiny Hugging Face Llama built from a config (4 heads, 4 key/value
heads, so every size divides them)."""
import os

import pytest

from dist_harness import run_function
from hf_fixture import tiny_llama
from lm_steps import train_lm_steps
import repo_paths
from script_modules import load_script

SEQ, VOCAB, MICRO = 8, 64, 2


def _tokens(step):
    import torch

    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def run_body(tp, stage, first, steps, load=None, save=None, full_out=None):
    """Train steps [first, first + steps) at tensor size tp (dp = world / tp, the same global
    batch of MICRO rows split over data ranks), after loading `load`, then save to `save`."""
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm

    net = tiny_llama(VOCAB, kv_heads=4, attn="eager")
    world = comm.get_world_size()
    dp = world // tp
    cfg = {"train_micro_batch_size_per_gpu": MICRO // dp, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    if load:
        engine.load_checkpoint(load)
        assert engine.global_steps == first
    losses = train_lm_steps(engine, _tokens, range(first, first + steps), MICRO // dp)
    if save:
        engine.save_checkpoint(save, tag="t")
        # DeepSpeed's engine.checkpoint_mp_rank names this rank's model-states file
        assert engine.checkpoint_mp_rank == engine.mesh.rank("tensor")
        assert os.path.exists(os.path.join(save, "t", f"mp_rank_{engine.checkpoint_mp_rank:02d}_model_states.pt"))
    full = None
    if full_out:
        from dslaunch.runtime.tensor_parallel import full_state_dict

        full = full_state_dict(engine.module) if tp > 1 else dict(engine.module.state_dict())
        full = {k: v.detach().float().clone() for k, v in full.items()} if engine.global_rank == 0 else None
    files = sorted(os.listdir(os.path.join(save, "t"))) if save and engine.global_rank == 0 else None
    return losses, files, full


def test_resume_across_tensor_sizes_2_to_1_to_4_equals_uninterrupted(tmp_path):
    whole = run_function(run_body, nprocs=2, kwargs=dict(tp=2, stage=1, first=0, steps=6), timeout=300)[0][0]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    first = run_function(run_body, nprocs=2, kwargs=dict(tp=2, stage=1, first=0, steps=2, save=a), timeout=300)
    files = first[0][1]
    # DeepSpeed's layout: a model-states file per tensor rank, ZeRO-1 shards per (data, tensor) rank
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
            "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"} <= set(files)
    second = run_function(run_body, nprocs=1, kwargs=dict(tp=1, stage=0, first=2, steps=2, load=a, save=b),
                          timeout=300)
    third = run_function(run_body, nprocs=4, kwargs=dict(tp=4, stage=2, first=4, steps=2, load=b), timeout=400)
    resumed = first[0][0] + second[0][0] + third[0][0]
    assert max(abs(x - y) for x, y in zip(resumed, whole)) < 1e-5, (resumed, whole)


def test_tp2_by_dp2_resumes_at_tp1_by_dp2_and_consolidates(tmp_path):
    from dslaunch.runtime.checkpoint.consolidate import consolidate_checkpoint

    whole = run_function(run_body, nprocs=4, kwargs=dict(tp=2, stage=2, first=0, steps=4), timeout=400)[0][0]
    a = str(tmp_path / "a")
    first = run_function(run_body, nprocs=4, kwargs=dict(tp=2, stage=2, first=0, steps=2, save=a, full_out=True),
                         timeout=400)
    second = run_function(run_body, nprocs=2, kwargs=dict(tp=1, stage=1, first=2, steps=2, load=a), timeout=300)
    resumed = first[0][0] + second[0][0]
    assert max(abs(x - y) for x, y in zip(resumed, whole)) < 1e-5, (resumed, whole)
    full = first[0][2]
    consolidated = consolidate_checkpoint(a, "t")
    assert set(consolidated) == set(full)
    assert max(float((consolidated[k] - full[k]).abs().max()) for k in full) < 1e-6


# -- DeepSpeed's AutoTP checkpoints (scripts/make_ds_tp_fixtures.py, real DeepSpeed 0.19.8) ---------------
FIXTURES = os.path.join(repo_paths.DATA, "ds_autotp")


def resume_ds_body(case, tp, stage):
    """Resume DeepSpeed's checkpoint of `case` at tensor size tp (dp = world / tp) and train
    the fixture's steps after the save; the losses averaged over the data ranks."""
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm

    fx = load_script("make_ds_tp_fixtures")
    world = comm.get_world_size()
    dp = world // tp
    cfg = {"train_micro_batch_size_per_gpu": fx.ROWS // dp, "steps_per_print": 1000, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    model = fx.make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.load_checkpoint(os.path.join(FIXTURES, case))
    assert engine.global_steps == fx.SAVE_AT
    losses = train_lm_steps(engine, fx.tokens, range(fx.SAVE_AT, fx.STEPS), fx.ROWS // dp)
    return losses


# DeepSpeed's ZeRO checkpoints re-cut for another tensor size and layout; its stage-0 ones (a torch
# optimizer state without parameter names) resume at the tensor size that saved them.
@pytest.mark.parametrize("case,tp,world,stage", [("tp2_s1_fp32", 2, 2, 1), ("tp2_s1_fp32", 1, 1, 0),
                                                 ("tp2_s1_fp32", 1, 2, 2), ("tp2_s0_fp32", 2, 2, 0)])
def test_deepspeed_autotp_checkpoint_resumes_with_deepspeeds_losses(case, tp, world, stage):
    import json

    expected = json.load(open(os.path.join(FIXTURES, "expected.json")))[case]["deepspeed"][3:]
    got = run_function(resume_ds_body, nprocs=world, kwargs=dict(case=case, tp=tp, stage=stage), timeout=300)[0]
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-5, (got, expected)
