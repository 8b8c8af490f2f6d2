"""Hugging Face MoE models (tiny Mixtral, Qwen2-MoE) train under ZeRO-2 and ZeRO-3 on 2 ranks
with the losses of one process, including steps where an expert gets no tokens on one rank.

The training script is scripts/make_ds_hf_moe_fixtures.py's `train` (DeepSpeed 0.19.8 ran it to
make tests/data/ds_hf_moe/expected.json), here with `import dslaunch.runtime as deepspeed` and
the compatibility package's `deepspeed.utils.set_z3_leaf_modules`. Its router is rigged so
expert 3 gets no tokens on rank 0 and all of rank 1's, at every step and layer.

    mixtral, qwen2_moe (transformers' fused experts): ZeRO 2, ZeRO 3 with the sparse block as a
        leaf, and (Mixtral) ZeRO 3 without it
    mixtral_list (a ModuleList of experts, only those with tokens called): ZeRO 2, ZeRO 3 with
        the leaf; without it ZeRO 3 refuses in one line naming set_z3_leaf_modules (DeepSpeed
        gathers different experts on the two ranks, then fails the first step)

Every run equals the one-process run of its model to 1e-5 and routes the same tokens, and
equals DeepSpeed's run of the same case (except mixtral_list at ZeRO 2, where DeepSpeed
crashes: fx.DS_FAILS). The collective watchdog (comms_timeout) would turn a hang into a failed
rank.
"""
import json
import os

import pytest

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
fx = load_script("make_ds_hf_moe_fixtures")
EXPECTED = json.load(open(os.path.join(ROOT, "tests", "data", "ds_hf_moe", "expected.json")))
TOL = 1e-5
COMPAT_ENV = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "compat", "deepspeed"),
                                                         os.environ.get("PYTHONPATH", "")) if p)}
WATCHDOG = {"comms_timeout": 60}  # a hang fails the rank (exit 124) long before the harness's timeout
NO_LEAF_S3 = {"mixtral_w2_s3": dict(model="mixtral", world=2, stage=3, gas=1, leaf=False)}
TWO_RANKS = [n for n, c in fx.CASES.items() if c["world"] == 2] + list(NO_LEAF_S3)
ONE_RANK = [n for n, c in fx.CASES.items() if c["world"] == 1]

pytest.importorskip("transformers")


def _worker(names):
    import torch.distributed as dist

    import dslaunch.runtime as deepspeed
    from deepspeed.utils import set_z3_leaf_modules  # the compatibility package's

    from dslaunch.runtime.zero import hook_scope

    assert set_z3_leaf_modules is hook_scope.set_z3_leaf_modules
    cases = dict(fx.CASES, **NO_LEAF_S3)
    out = {n: fx.train(deepspeed, set_z3_leaf_modules, cases[n], dist.get_rank(), WATCHDOG) for n in names}
    if dist.get_world_size() == 2:
        try:
            fx.train(deepspeed, set_z3_leaf_modules, dict(fx.CASES["mixtral_list_w2_s3_leaf"], leaf=False),
                     dist.get_rank(), WATCHDOG)
            out["refusal"] = None
        except deepspeed.ConfigError as exc:
            out["refusal"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs():
    two = run_function(_worker, nprocs=2, kwargs={"names": TWO_RANKS}, timeout=400, env=COMPAT_ENV)
    one = run_function(_worker, nprocs=1, kwargs={"names": ONE_RANK}, timeout=300, env=COMPAT_ENV)
    assert two[0] == two[1]
    return dict(two[0], **one[0])


def _close(a, b):
    return max(abs(x - y) for x, y in zip(a, b)) <= TOL


def test_rigged_router_leaves_an_expert_without_tokens_on_one_rank(runs):
    for name in TWO_RANKS:
        for rank0, rank1 in runs[name]["expert_tokens"]:
            assert rank0[fx.RIGGED_EXPERT] == 0 and rank1[fx.RIGGED_EXPERT] == fx.ROWS * fx.SEQ, name


@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks_equal_one_process(runs, name):
    model = (fx.CASES.get(name) or NO_LEAF_S3[name])["model"]
    one = runs[f"{model}_one"]
    assert len(runs[name]["losses"]) == fx.STEPS
    assert _close(runs[name]["losses"], one["losses"]), (name, runs[name]["losses"], one["losses"])
    assert runs[name]["expert_tokens"] == one["expert_tokens"]


def test_expert_list_without_leaf_is_refused_at_zero3_in_one_line(runs):
    msg = runs["refusal"]
    assert msg is not None and "\n" not in msg
    assert "deepspeed.utils.set_z3_leaf_modules(model, [ListSparseMoeBlock])" in msg and "ZeRO stage 3" in msg


@pytest.mark.parametrize("name", [n for n in fx.CASES if n not in fx.DS_FAILS])
def test_losses_equal_deepspeed(runs, name):
    ds = EXPECTED[name]
    assert runs[name]["expert_tokens"] == ds["expert_tokens"]
    assert _close(runs[name]["losses"], ds["losses"]), (name, runs[name]["losses"], ds["losses"])

