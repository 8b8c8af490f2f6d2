"""MoE training with expert parallelism equals one process holding every expert, and
equals real DeepSpeed 0.19.8.

The training script is scripts/make_ds_moe_fixtures.py's `train` (DeepSpeed ran it to make
tests/data/ds_moe/expected.json): dense layer, MoE(num_experts=4, drop_tokens=False,
use_rts=False), dense layer; MSE + 0.01 x aux loss; AdamW; 4 steps. Here it runs with
`import dslaunch.runtime as deepspeed` and the layer from `deepspeed.moe.layer`:

    2 ranks: ep 1 ZeRO 0; ep 2 ZeRO 0 and 2; ep 2 top-2 (no second-expert sampling) ZeRO 0
    4 ranks: ep 2 x expert-data-parallel 2, ZeRO 1
    1 rank:  all 4 experts, the per-rank batches as gradient-accumulation micro-batches
    and with gradient clipping (the global norm counts every expert once): ep 2 ZeRO 0 and
    2 on 2 ranks, ep 2 x 2 ZeRO 1 on 4 ranks, and their one-process runs

Every run's losses equal DeepSpeed's for the same case and the one-process run's (1e-5)
(except ZeRO 0 with clipping, where DeepSpeed's own ep 2 run differs from its one-process
run and ours equals the one-process run),
and the tokens routed to each expert, summed over ranks, equal the one process's exactly.
What expert parallelism does not do here (ep_size not dividing the world, ZeRO-3, an
optimizer without moe groups at ZeRO 1-2) is one line each; at ZeRO 0 a script's own
optimizer may hold experts in any param group, as in DeepSpeed; checkpoints are tests/runtime/moe/test_moe_checkpoint.py's.
"""
import json
import os

import pytest

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
fx = load_script("make_ds_moe_fixtures")
EXPECTED = json.load(open(os.path.join(ROOT, "tests", "data", "ds_moe", "expected.json")))
TOL = 1e-5
# the compatibility package from its source folder (no install: nothing else sees `deepspeed`)
COMPAT_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "compat", "deepspeed"),
                                                         os.environ.get("PYTHONPATH", "")) if p)}
BY_WORLD = {w: [n for n, job in fx.TRAINING_CASES.items() if job["world"] == w] for w in (1, 2, 4)}
# stage-0 cases run again with the script's own optimizer holding experts and shared parameters
# in one param group (DeepSpeed's PRMoE test does this): DeepSpeed's stage 0 reduces each
# parameter by what it is, so the losses are the case's own
ONE_GROUP = ["ep2_w2_s0", "ep2_w2_s0_clip"]


def _worker(names):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from deepspeed.moe import layer  # the compatibility package's name for dslaunch.runtime.moe.layer

    from deepspeed.moe import utils as moe_utils

    import dslaunch.runtime.moe.utils

    assert layer.MoE.__module__ == "dslaunch.runtime.moe.layer" and moe_utils is dslaunch.runtime.moe.utils
    out = {n: fx.train(deepspeed, layer, fx.TRAINING_CASES[n], dist.get_rank()) for n in names}
    if dist.get_world_size() == 2:
        out["refusals"] = _refusals(deepspeed, layer)
        for n in ONE_GROUP:
            out[f"{n}_one_group"] = fx.train(deepspeed, layer, fx.TRAINING_CASES[n], dist.get_rank(), one_group=True)
    return out


def _refusals(deepspeed, layer):
    """The one-line errors of what expert parallelism does not do here (2 ranks)."""
    import torch

    from dslaunch.runtime.moe.utils import split_params_into_different_moe_groups_for_optimizer

    def attempt(ep=2, num_experts=4, stage=0, optimizer=None):
        model = fx.make_model(layer, ep, 0, 1) if num_experts == 4 else torch.nn.Sequential(
            layer.MoE(fx.H, torch.nn.Linear(fx.H, fx.H), num_experts=num_experts, ep_size=ep))
        job = dict(world=2, ep=ep, stage=stage, k=1, gas=1)
        cfg = fx.config(job)
        if optimizer is not None:
            cfg.pop("optimizer")
            optimizer = optimizer(model)
        try:
            deepspeed.initialize(model=model, optimizer=optimizer, config=cfg,
                                 model_parameters=None if optimizer else list(model.parameters()))
        except deepspeed.ConfigError as exc:
            return str(exc)
        return None

    return {
        "ep_not_dividing_world": attempt(ep=4),
        "zero3": attempt(stage=3),
        "optimizer_without_moe_group": attempt(stage=2, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
        "optimizer_with_moe_group": attempt(optimizer=lambda m: torch.optim.SGD(
            split_params_into_different_moe_groups_for_optimizer({"params": list(m.parameters()), "name": "d"}),
            lr=0.1)),
    }


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world, names in BY_WORLD.items():
        out.update(run_function(_worker, nprocs=world, kwargs={"names": names}, timeout=240,
                                env=COMPAT_ENV)[0])
    assert "refusals" in out
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(fx.TRAINING_CASES))
def test_losses_and_routing_equal_deepspeed(runs, name):
    got, want = runs[name], EXPECTED[name]
    if name in fx.DS_DIFFERS_FROM_ONE_PROCESS:
        # DeepSpeed's ZeRO-0 clipping norm under expert parallelism is not one process's; ours
        # is, and equals DeepSpeed's one-process run (and its ZeRO 1/2 runs) instead
        one = EXPECTED[fx.ONE_PROCESS[name]]
        assert want["losses"] != pytest.approx(one["losses"], abs=1e-6)
        want = one
    assert got["losses"] == pytest.approx(want["losses"], abs=TOL), name
    assert got["counts"] == want["counts"], name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(fx.ONE_PROCESS))
def test_expert_parallel_equals_one_process_holding_every_expert(runs, name):
    one = runs[fx.ONE_PROCESS[name]]
    assert runs[name]["losses"] == pytest.approx(one["losses"], abs=TOL), name
    assert runs[name]["counts"] == one["counts"], name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ONE_GROUP)
def test_stage_0_trains_experts_in_any_param_group(runs, name):
    want = EXPECTED[fx.ONE_PROCESS[name]] if name in fx.DS_DIFFERS_FROM_ONE_PROCESS else EXPECTED[name]
    assert runs[f"{name}_one_group"]["losses"] == pytest.approx(want["losses"], abs=TOL), name
    assert runs[f"{name}_one_group"]["counts"] == want["counts"], name


@pytest.mark.timeout(600)
def test_what_expert_parallelism_does_not_do_is_one_line(runs):
    got = runs["refusals"]
    assert got["ep_not_dividing_world"] == "MoE ep_size 4 does not divide the data-parallel size 2 (the world)"
    assert got["zero3"].startswith("Native DeepSpeed MoE is not supported with ZeRO Stage 3: ")
    assert got["optimizer_without_moe_group"] == (
        "optimizer: an expert parameter is in a param group without \"moe\": True; build the groups with "
        "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer")
    assert got["optimizer_with_moe_group"] is None
    assert all("\n" not in v for v in got.values() if v)
