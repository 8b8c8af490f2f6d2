"""MoE training with expert parallelism equals one process holding every expert, and
equals real DeepSpeed 0.19.8.

The training script is scripts/make_ds_moe_fixtures.py's `train` (DeepSpeed ran it to make
tests/data/ds_moe/expected.json): dense layer, MoE(num_experts=4, drop_tokens=False,
use_rts=False), dense layer; MSE + 0.01 x aux loss; AdamW; 4 steps. Here it runs with
`import dslaunch.runtime as deepspeed` and the layer from `deepspeed.moe.layer`:

    2 ranks: ep 1 ZeRO 0; ep 2 ZeRO 0 and 2; ep 2 top-2 (no second-expert sampling) ZeRO 0
    4 ranks: ep 2 x expert-data-parallel 2, ZeRO 1
    1 rank:  all 4 experts, the per-rank batches as gradient-accumulation micro-batches

Every run's losses equal DeepSpeed's for the same case and the one-process run's (1e-5),
and the tokens routed to each expert, summed over ranks, equal the one process's exactly.
"""
import importlib.util
import json
import os

import pytest

from dist_harness import run_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("make_ds_moe_fixtures",
                                               os.path.join(ROOT, "scripts", "make_ds_moe_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)
EXPECTED = json.load(open(os.path.join(ROOT, "tests", "data", "ds_moe", "expected.json")))
TOL = 1e-5
# the compatibility package from its source folder (no install: nothing else sees `deepspeed`)
COMPAT_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "compat", "deepspeed"),
                                                         os.environ.get("PYTHONPATH", "")) if p)}
BY_WORLD = {w: [n for n, job in fx.TRAINING_CASES.items() if job["world"] == w] for w in (1, 2, 4)}


def _worker(names):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from deepspeed.moe import layer  # the compatibility package's name for dslaunch.runtime.moe.layer

    assert layer.MoE.__module__ == "dslaunch.runtime.moe.layer"
    return {n: fx.train(deepspeed, layer, fx.TRAINING_CASES[n], dist.get_rank()) for n in names}


@pytest.fixture(scope="module")
def runs():
    out = {}
    for world, names in BY_WORLD.items():
        out.update(run_function(_worker, nprocs=world, kwargs={"names": names}, timeout=240,
                                env=COMPAT_ENV)[0])
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(fx.TRAINING_CASES))
def test_losses_and_routing_equal_deepspeed(runs, name):
    got, want = runs[name], EXPECTED[name]
    assert got["losses"] == pytest.approx(want["losses"], abs=TOL), name
    assert got["counts"] == want["counts"], name


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(fx.ONE_PROCESS))
def test_expert_parallel_equals_one_process_holding_every_expert(runs, name):
    one = runs[fx.ONE_PROCESS[name]]
    assert runs[name]["losses"] == pytest.approx(one["losses"], abs=TOL), name
    assert runs[name]["counts"] == one["counts"], name
