"""Optimizer state between optimizers (issue #23 section 1): checkpoint/optimizer_state.py.

The DeepSpeed fixtures (tests/data/ds_interop, scripts/make_ds_fixtures.py) prove each
optimizer's checkpoints resume with DeepSpeed's losses (test_checkpoint_deepspeed.py). Here:
issue 23's exact case, the forms DeepSpeed's optimizers keep that the fixtures cannot all
show (FusedLamb needs CUDA; FusedAdam's stage-0 step counts), the reverse form that
DeepSpeed's load_checkpoint needs, and the one-line refusals.
"""
import json
import os

import pytest
import torch

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
DATA = os.path.join(ROOT, "tests", "data", "ds_interop")
fx = load_script("make_ds_fixtures")
with open(os.path.join(DATA, "expected.json")) as _fh:
    EXPECTED = json.load(_fh)
ISSUE = "adam_s2_fp32_step6"


def _optimizer(cls, **kw):
    p = torch.nn.Parameter(torch.zeros(3))
    return cls([p], **kw)


# -- issue 23's case ------------------------------------------------------------------------------
def resume_body(data, case, optimizer, stage):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed

    c = fx.CASES[case]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = fx.make_model()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=fx.config(stage, c.dtype, world, optimizer))[0]
    engine.load_checkpoint(os.path.join(data, "ds", case))
    losses = []
    for step in range(engine.global_steps, c.steps):
        x, y = fx.batch(step, rank, world, torch.float32)
        loss = (engine(x) - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    opt = engine.strategy.optimizer
    steps = sorted({float(st["step"]) for st in opt.state.values() if "step" in st})
    return {"losses": losses, "steps": steps, "optimizer": type(opt).__name__}


@pytest.mark.timeout(300)
def test_issue23_deepspeed_zero2_default_adam_checkpoint_from_step6_resumes_on_two_ranks():
    """Real DeepSpeed, 2 ranks, ZeRO-2, "optimizer": {"type": "Adam"} (its FusedAdam: an int
    step per partition, a group "step" of 0), saved at step 6: dslaunch resumes it with
    DeepSpeed's own losses for steps 7-9."""
    from dslaunch.runtime.checkpoint.files import load_torch

    c = fx.CASES[ISSUE]
    assert (c.stage, c.dtype, c.optimizer, c.save_at) == (2, "fp32", "adam", 6)
    saved = load_torch(os.path.join(DATA, "ds", ISSUE, "global_step6", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    base = saved["optimizer_state_dict"]["base_optimizer_state"]
    assert base["state"][0]["step"] == 6 and type(base["state"][0]["step"]) is int
    assert base["param_groups"][0]["step"] == 0
    outs = run_function(resume_body, nprocs=2, timeout=250,
                        kwargs={"data": DATA, "case": ISSUE, "optimizer": "adam", "stage": 2})
    want = EXPECTED[ISSUE]["deepspeed"][6:]
    for out in outs:
        assert out["optimizer"] == "FusedAdam"  # DeepSpeed's class for "Adam" on CPU parameters
        assert out["losses"] == pytest.approx(want, rel=1e-5), (out["losses"], want)
        assert out["steps"] == [9.0]  # counted on from DeepSpeed's 6


def test_deepspeed_resumed_issue23_case_written_by_dslaunch():
    """The fixture script ran DeepSpeed's load_checkpoint on dslaunch's checkpoint of the same
    run: it stepped on with our losses. What made it possible: FusedAdam's form on disk."""
    from dslaunch.runtime.checkpoint.files import load_torch

    exp = EXPECTED[ISSUE]
    assert exp["deepspeed_resumed_dslaunch"] == pytest.approx(exp["dslaunch"][6:], rel=1e-5)
    assert exp["dslaunch"] == pytest.approx(exp["deepspeed"], rel=1e-5)
    ours = load_torch(os.path.join(DATA, "dslaunch", ISSUE, "global_step6", "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    base = ours["optimizer_state_dict"]["base_optimizer_state"]
    assert base["state"][0]["step"] == 6 and type(base["state"][0]["step"]) is int
    assert base["param_groups"][0]["bias_correction"] is True  # FusedAdam.step reads it


# -- the forms, without processes ------------------------------------------------------------------
def test_fused_adam_stage0_counts_on_its_last_parameter():
    """FusedAdam steps a group with the count of its last parameter; the others keep their
    first count, and the group's "step" stays 0."""
    from dslaunch.kernels import CPUAdam
    from dslaunch.runtime.checkpoint.optimizer_state import to_ours

    ours = CPUAdam([torch.nn.Parameter(torch.zeros(2)) for _ in range(3)], lr=0.5)
    z = torch.zeros(2)
    saved = {"state": {i: {"step": s, "exp_avg": z + i, "exp_avg_sq": z + 1} for i, s in enumerate((0, 0, 6))},
             "param_groups": [{"lr": 0.02, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
                               "weight_decay": 0.01, "step": 0, "params": [0, 1, 2]}]}
    got = to_ours({"optimizer": saved, "fp32_masters": None}, ours, "checkpoint X")["optimizer"]
    for i in range(3):
        assert torch.is_tensor(got["state"][i]["step"]) and got["state"][i]["step"].dtype == torch.float32
        assert float(got["state"][i]["step"]) == 6.0
        assert torch.equal(got["state"][i]["exp_avg"], z + i)
    group = got["param_groups"][0]
    assert group["lr"] == 0.02 and "step" not in group and "bias_correction" not in group
    assert set(group) == set(ours.param_groups[0])  # every key CPUAdam reads, the saved values where it has them
    ours.load_state_dict(got)
    for p in ours.param_groups[0]["params"]:
        p.grad = torch.ones(2)
    ours.step()  # the step that failed in issue 23 (an int step in torch._foreach_add_)
    assert {float(ours.state[p]["step"]) for p in ours.param_groups[0]["params"]} == {7.0}


def test_torch_steps_stay_per_parameter():
    from dslaunch.runtime.checkpoint.optimizer_state import to_ours

    ours = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2)) for _ in range(2)])
    saved = ours.state_dict()
    saved["state"] = {i: {"step": torch.tensor(float(s)), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
                      for i, s in enumerate((3, 5))}
    got = to_ours({"optimizer": saved}, ours, "c")["optimizer"]
    assert [float(got["state"][i]["step"]) for i in (0, 1)] == [3.0, 5.0]


def _shard(state):
    return {"format": "dslaunch-zero-shard/1", "stage": 2, "world_size": 1, "rank": 0,
            "groups": [{"pieces": [{"name": "w", "start": 0, "end": 3, "offset": 0}], "shapes": {"w": [3]},
                        "master": {"w": torch.zeros(3)}, "state": state}],
            "param_groups": [{"lr": 0.1, "eps": 1e-10, "weight_decay": 0.0, "amsgrad": False}]}


def test_deepspeed_cpu_adagrad_sum_is_adagrads_sum():
    from dslaunch.kernels import CPUAdagrad
    from dslaunch.runtime.checkpoint.optimizer_state import for_deepspeed_group_state, to_ours

    ours = _optimizer(CPUAdagrad, lr=0.05)
    sums = {"w": torch.tensor([1.0, 2.0, 3.0])}
    got = to_ours(_shard({"step": 4, "exp_avg_sq": sums}), ours, "c")
    state = got["groups"][0]["state"]
    assert set(state) == {"step", "sum"} and state["sum"] is sums and float(state["step"]) == 4.0
    assert got["param_groups"] == [{"lr": 0.1, "eps": 1e-10, "weight_decay": 0.0}]  # amsgrad: not Adagrad's key
    # and back: what DeepSpeedCPUAdagrad reads
    back = for_deepspeed_group_state({"step": torch.tensor(4.0), "sum": torch.ones(3)}, "DeepSpeedCPUAdagrad")
    assert set(back) == {"step", "exp_avg_sq"} and back["step"] == 4 and type(back["step"]) is int


def test_deepspeed_cpu_lion_unused_second_moment_is_dropped_only_when_unused():
    from dslaunch.kernels import CPULion
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.checkpoint.optimizer_state import to_ours

    ours = _optimizer(CPULion)
    m = {"w": torch.ones(3)}
    got = to_ours(_shard({"step": 2, "exp_avg": m, "exp_avg_sq": {"w": torch.zeros(3)}}), ours, "c")
    assert set(got["groups"][0]["state"]) == {"step", "exp_avg"}
    with pytest.raises(CheckpointError) as info:  # Adam's moments are not Lion's
        to_ours(_shard({"step": 2, "exp_avg": m, "exp_avg_sq": {"w": torch.ones(3)}}), ours, "checkpoint /c")
    assert str(info.value) == ("checkpoint /c (param group 0): optimizer state 'exp_avg_sq' is not one Lion keeps "
                               "(exp_avg, step); was it saved with another optimizer?")


def test_wrong_or_missing_state_is_one_line_naming_the_key():
    from dslaunch.kernels import CPUAdam
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.checkpoint.optimizer_state import to_ours

    ours = _optimizer(CPUAdam)
    with pytest.raises(CheckpointError) as info:  # a Lion state into Adam
        to_ours(_shard({"step": 2, "exp_avg": {"w": torch.ones(3)}}), ours, "checkpoint /c")
    assert str(info.value) == ("checkpoint /c (param group 0): optimizer state lacks 'exp_avg_sq', which Adam keeps "
                               "(the saved state has exp_avg, step)")
    with pytest.raises(CheckpointError) as info:
        to_ours(_shard({"step": "six", "exp_avg": {"w": torch.ones(3)}, "exp_avg_sq": {"w": torch.ones(3)}}), ours,
                "checkpoint /c")
    assert str(info.value) == "checkpoint /c: optimizer state 'step' is str, not a step count"
    with pytest.raises(CheckpointError) as info:
        to_ours(_shard({"step": 1, "exp_avg": {"w": torch.ones(3)}, "exp_avg_sq": {"w": torch.ones(3)},
                        "momentum_buffer": {"w": torch.ones(3)}}), ours, "checkpoint /c")
    assert "optimizer state 'momentum_buffer' is not one Adam keeps" in str(info.value)


def test_forms_of_deepspeeds_optimizers_and_back():
    """What DeepSpeed 0.19.8 builds per config (engine._configure_basic_optimizer), and its
    state form round-trips through ours."""
    from dslaunch.kernels import Lamb
    from dslaunch.runtime.checkpoint.optimizer_state import deepspeed_optimizer, for_deepspeed_torch, to_ours

    assert deepspeed_optimizer("Adam", {}, False) == "FusedAdam"
    assert deepspeed_optimizer("AdamW", {"torch_adam": True}, False) is None
    assert deepspeed_optimizer("Adam", {}, True) == "DeepSpeedCPUAdam"
    assert deepspeed_optimizer("Lion", {}, True) == "DeepSpeedCPULion"
    assert deepspeed_optimizer("Lion", {}, False) == "FusedLion"
    assert deepspeed_optimizer("Adagrad", {}, False) is None  # torch's
    assert deepspeed_optimizer("Adagrad", {}, True) == "DeepSpeedCPUAdagrad"
    assert deepspeed_optimizer("Lamb", {}, False) == "FusedLamb"
    assert deepspeed_optimizer("SGD", {}, False) is None

    # FusedLamb needs CUDA, so no DeepSpeed fixture has it: its form is FusedAdam's plus its group keys
    ours = Lamb([torch.nn.Parameter(torch.ones(3))], lr=0.01)
    ours.param_groups[0]["params"][0].grad = torch.ones(3)
    ours.step()
    sd = ours.state_dict()
    ds = for_deepspeed_torch(sd, "FusedLamb")
    assert ds["state"][0]["step"] == 1 and type(ds["state"][0]["step"]) is int
    assert {"bias_correction", "max_grad_norm", "max_coeff", "min_coeff"} <= set(ds["param_groups"][0])
    back = to_ours({"optimizer": ds}, ours, "c")["optimizer"]
    assert torch.equal(back["state"][0]["step"], sd["state"][0]["step"])
    assert back["param_groups"] == sd["param_groups"]


def wrong_optimizer_body(data):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint import CheckpointError

    model = fx.make_model()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config=fx.config(2, "fp32", 1, "lion_offload"))[0]
    try:
        engine.load_checkpoint(os.path.join(data, "ds", ISSUE))
    except CheckpointError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
def test_adam_checkpoint_into_lion_is_refused_in_one_line():
    got = run_function(wrong_optimizer_body, nprocs=1, timeout=250, kwargs={"data": DATA})[0]
    path = os.path.join(DATA, "ds", ISSUE, "global_step6")
    assert got == (f"checkpoint {path} (param group 0): optimizer state 'exp_avg_sq' is not one Lion keeps "
                   "(exp_avg, step); was it saved with another optimizer?")


def _bf16_stage0_adagrad(save_dir, steps, save_at, resume):
    import dslaunch.runtime as deepspeed

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
               "optimizer": {"type": "Adagrad", "params": {"lr": 0.05}}, "zero_optimization": {"stage": 0}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    engine = build()
    losses = []
    for step in range(steps):
        if resume and step == save_at:
            engine.save_checkpoint(save_dir, tag="mid")
            engine = build()
            engine.load_checkpoint(save_dir, tag="mid")
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(2, 4, generator=g).to(torch.bfloat16), torch.randn(2, 2, generator=g)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def test_bf16_stage0_adagrad_saves_and_resumes(tmp_path):
    """torch's Adagrad fills its state at construction for the bf16 parameters, which stage 0
    then replaces by fp32 masters in the optimizer's groups: that state once stayed behind and
    made save_checkpoint fail with a bare KeyError (a generated differential case found it)."""
    straight = run_function(_bf16_stage0_adagrad, nprocs=1, kwargs={"save_dir": str(tmp_path), "steps": 4,
                                                                    "save_at": 2, "resume": False})[0]
    resumed = run_function(_bf16_stage0_adagrad, nprocs=1, kwargs={"save_dir": str(tmp_path), "steps": 4,
                                                                   "save_at": 2, "resume": True})[0]
    assert resumed == straight
