"""save_checkpoint / load_checkpoint of an AutoEP model (the `expert_parallel` section), in
DeepSpeed 0.19.8's layout: one file per expert (layer_{L}_expert_{E}, the expert's 2-D w1, w2,
w3 under its global id), the module without the stacked experts and the ds_autoep_layers
records in mp_rank_00, expp_rank_{R} optimizer files at ZeRO 0 and zero_pp_rank files at 1-2.

Each case trains scripts/make_ds_autoep_fixtures.py's Mixtral (2 ranks, autoep_size 2) for 4
steps straight, and again for 2 steps, saved, a fresh engine loaded from the checkpoint and 2
more steps: the resumed losses equal the uninterrupted run's to 1e-5 (fp32). ZeRO 0, 1, 2
with AdamW, and ZeRO 2 with Muon (its momentum buffer resumes too). The same checkpoint loads
at autoep_size 1 with load_optimizer_states=False (the weights, every expert on every rank,
equal the saved run's gathered model); with the optimizer state it is refused in one line. A
script's own universal_checkpoint_info in client_state is refused in one line, since the
checkpoint writes its own (DeepSpeed's MoE save refuses it too).
"""
import os

import pytest

from dist_harness import run_function
from script_modules import load_script

fx = load_script("make_ds_autoep_fixtures")
TOL = 1e-5
STEPS, SAVE_AT = 4, 2
CASES = {"s0": dict(stage=0), "s1": dict(stage=1), "s2": dict(stage=2), "s2_muon": dict(stage=2, muon=True)}

pytest.importorskip("transformers")


def _engine(deepspeed, case, ep=2):
    job = dict(model="mixtral", world=2, gas=1, stage=case["stage"], ep=ep, muon=case.get("muon", False))
    model = fx.make_model("mixtral")
    return deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                config=fx.config(job, {"comms_timeout": 120}))[0]


def _steps(engine, first, last, rank):
    import torch
    import torch.distributed as dist

    out = []
    for step in range(first, last):
        ids = fx.batch(step, rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        out.append(float(total) / 2)
    return out


def _worker(tmp):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.moe import autoep

    rank = dist.get_rank()
    out = {}
    for name, case in CASES.items():
        straight = _steps(_engine(deepspeed, case), 0, STEPS, rank)
        first = _engine(deepspeed, case)
        _steps(first, 0, SAVE_AT, rank)
        path = os.path.join(tmp, name)
        first.save_checkpoint(path)
        if name == "s1":  # the layer records are the checkpoint's own universal_checkpoint_info
            try:
                first.save_checkpoint(os.path.join(tmp, "client_uc"), client_state={"universal_checkpoint_info": {}})
                out["client_uc_info"] = None
            except deepspeed.CheckpointError as exc:
                out["client_uc_info"] = str(exc)
        gathered = autoep.hf_state_dict(first.module)
        files = sorted(os.listdir(os.path.join(path, f"global_step{SAVE_AT}"))) if rank == 0 else None
        resumed = _engine(deepspeed, case)
        resumed.load_checkpoint(path)
        out[name] = {"straight": straight, "resumed": _steps(resumed, SAVE_AT, STEPS, rank), "files": files}
        if name == "s2":
            one = _engine(deepspeed, case, ep=1)
            one.load_checkpoint(path, load_optimizer_states=False)
            mine = autoep.hf_state_dict(one.module)
            if rank == 0:
                out[name]["ep1_weights_equal"] = sorted(mine) == sorted(gathered) and all(
                    (mine[k] - gathered[k]).abs().max().item() == 0 for k in gathered)
            try:
                _engine(deepspeed, case, ep=1).load_checkpoint(path)
                out[name]["ep1_with_optimizer"] = None
            except deepspeed.CheckpointError as exc:
                out[name]["ep1_with_optimizer"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_function(_worker, nprocs=2, kwargs={"tmp": str(tmp_path_factory.mktemp("autoep_ckpt"))},
                        timeout=900)


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_equals_the_uninterrupted_run(runs, name):
    for rank in (0, 1):
        got = runs[rank][name]
        assert len(got["resumed"]) == STEPS - SAVE_AT
        assert max(abs(a - b) for a, b in zip(got["resumed"], got["straight"][SAVE_AT:])) <= TOL, got


@pytest.mark.parametrize("name", sorted(CASES))
def test_files_are_deepspeeds_layout(runs, name):
    files = set(runs[0][name]["files"])
    experts = {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(fx.EXPERTS)}
    assert experts <= files, sorted(files)
    assert "mp_rank_00_model_states.pt" in files
    if CASES[name]["stage"] == 0:
        assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"} <= files
    else:
        assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
        assert not any(f.startswith("expp_rank_") for f in files)


def test_weights_load_at_another_autoep_size_and_the_optimizer_state_is_refused_in_one_line(runs):
    assert runs[0]["s2"]["ep1_weights_equal"] is True
    for rank in (0, 1):
        msg = runs[rank]["s2"]["ep1_with_optimizer"]
        assert msg is not None and "\n" not in msg
        assert "saved at expert_parallel.autoep_size 2 and this job runs 1" in msg
        assert "load_optimizer_states=False" in msg


def test_a_scripts_universal_checkpoint_info_is_refused_where_autoep_writes_its_own(runs):
    for rank in (0, 1):
        msg = runs[rank]["client_uc_info"]
        assert msg is not None and "\n" not in msg
        assert msg.endswith("save_checkpoint: client_state key 'universal_checkpoint_info' is reserved for the "
                            "checkpoint's own 'universal_checkpoint_info' entry"), msg
