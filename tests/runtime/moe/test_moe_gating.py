"""The MoE gating functions (dslaunch.runtime.moe.gating) and the layer, in one process.

- Hand-computed: capacities (including one larger than the token count, which DeepSpeed's
  buffer exceeds; here it is capped), aux losses for each k, experts that get no tokens,
  dropping by capacity, drop_tokens=False agreeing on the busiest expert through agree_max.
- DeepSpeed 0.19.8 (tests/data/ds_moe/gating.pt, scripts/make_ds_moe_fixtures.py): the same
  logits and seed give DeepSpeed's routes, aux loss and expert counts for top-1 (RTS,
  RSample, used_token, no-drop), top-2 (sampled or not) and top-3; its MoE layer's
  state_dict loads into ours and gives its output, aux loss, counts and input gradient
  (k=1; k=2 with PR-MoE's residual; no-drop).
- Bad arguments are one line (a ConfigError, exit 2 from a script).
- split_params_into_different_moe_groups_for_optimizer.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from script_modules import load_script

from dslaunch.runtime.moe import gating
import repo_paths

ROOT = str(repo_paths.ROOT)
fx = load_script("make_ds_moe_fixtures")
FIXTURE = torch.load(os.path.join(ROOT, "tests", "data", "ds_moe", "gating.pt"), weights_only=False)


# -- hand-computed --------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,experts,cf,min_cap,k,want", [
    (16, 4, 1.0, 0, 1, 4),    # ceil(16 / 4 x 1)
    (10, 4, 1.0, 0, 1, 3),    # ceil(2.5)
    (16, 4, 1.25, 0, 2, 10),  # ceil(4 x 2.5)
    (16, 4, 0.1, 2, 1, 2),    # ceil(0.4) = 1, floored at min_capacity 2
    (6, 2, 4.0, 1, 1, 6),     # ceil(12) above the 6 tokens: capped (DeepSpeed sizes 12)
    (5, 4, 4.0, 1, 3, 5),     # ceil(15): capped
    (3, 4, 1.0, 8, 1, 3),     # min_capacity above the token count: capped too
])
def test_capacity(tokens, experts, cf, min_cap, k, want):
    assert gating.capacity(tokens, experts, cf, min_cap, k) == want


def _onehot_logits(choices, experts, scale=4.0):
    logits = torch.zeros(len(choices), experts)
    for t, e in enumerate(choices):
        logits[t, e] = scale
    return logits


def test_top1_aux_loss_counts_and_an_expert_with_no_tokens():
    choices = [0, 0, 0, 1, 1, 2]  # expert 3 gets nothing
    logits = _onehot_logits(choices, 4)
    r = gating.top1_gating(logits, capacity_factor=1.0, min_capacity=0, drop_tokens=True, use_rts=False)
    gates = torch.softmax(logits, dim=1)
    frac = torch.tensor([3, 2, 1, 0]) / 6
    assert torch.allclose(r.l_aux, (gates.mean(0) * frac).sum() * 4)
    assert r.exp_counts.tolist() == [3, 2, 1, 0]
    assert r.capacity == 2  # ceil(6 / 4)
    # expert 0 keeps 2 of its 3 tokens; the kept ones sit in slots 0 and 1
    assert (r.indices[0] == 0).sum() == 2 and (r.indices[0] == -1).sum() == 1
    assert sorted(r.locations[0][r.indices[0] == 0].tolist()) == [0, 1]
    assert r.locations[0][3:].tolist() == [0, 1, 0]
    p = gates[0, 0].item()
    assert torch.allclose(r.weights[0][r.indices[0] >= 0], torch.tensor([p, p, p, p, p]))
    assert float(r.weights[0][r.indices[0] == -1]) == 0.0
    cw = r.combine_weights()
    assert cw.shape == (6, 4, 2) and cw[:, 3].abs().sum() == 0  # nothing reaches expert 3


def test_top1_drop_tokens_false_sizes_to_the_busiest_expert_agreed_over_the_group():
    logits = _onehot_logits([0, 0, 0, 1], 2)
    asked = []

    def agree_max(local):
        asked.append(int(local))
        return torch.tensor(4)  # another rank's busiest expert had 4 tokens

    r = gating.top1_gating(logits, min_capacity=0, drop_tokens=False, use_rts=False, agree_max=agree_max)
    assert asked == [3] and r.capacity == 4 and (r.indices >= 0).all()
    alone = gating.top1_gating(logits, min_capacity=0, drop_tokens=False, use_rts=False)
    assert alone.capacity == 3


def test_top2_aux_loss_weights_and_second_choice_queues_behind_first():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0], [2.0, 0.0, 3.0]])
    r = gating.top2_gating(logits, capacity_factor=1.0, min_capacity=0, drop_tokens=False,
                           second_expert_sampling=False)
    gates = torch.softmax(logits, dim=1)
    first = torch.tensor([2, 1, 1]) / 4  # fraction of first choices per expert
    assert torch.allclose(r.l_aux, (gates.mean(0) * first).mean() * 9)
    assert r.indices.tolist() == [[0, 0, 1, 2], [1, 2, 2, 0]]
    assert r.exp_counts.tolist() == [3, 2, 3]
    # expert 0: firsts of tokens 0, 1 in slots 0, 1; token 3's second choice after them: slot 2
    assert r.locations.tolist() == [[0, 1, 0, 0], [1, 1, 2, 2]]
    g = gates.gather(1, r.indices.t())
    assert torch.allclose(r.weights.t(), g / g.sum(1, keepdim=True))
    assert r.capacity == 3


def test_topk_aux_loss_and_capacity_drop_keeps_the_most_probable_tokens():
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0], [0.0, 4.0, 3.0, 0.0], [3.0, 0.0, 0.0, 4.0],
                           [4.0, 0.0, 3.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    k = 3
    r = gating.topk_gating(logits, k=k, capacity_factor=0.25, min_capacity=0, drop_tokens=True)
    gates = torch.softmax(logits, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, torch.topk(gates, k, dim=1)[1], True)
    assert torch.allclose(r.l_aux, (gates.mean(0) * mask.float().mean(0)).mean() * 16 / k)
    assert r.capacity == math.ceil(5 / 4 * 0.25 * 3)  # 1 slot per expert
    for e in range(4):  # each expert keeps exactly the one token that gave it the highest probability
        kept = (r.indices == e).nonzero()[:, 1].tolist()
        chose = mask[:, e].nonzero().flatten()
        assert kept == [int(chose[gates[chose, e].argmax()])]


def test_route_dispatches_on_k():
    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    for k in (1, 2, 3):
        r = gating.route(logits, k, 1.0, 1, use_rts=False, second_expert_sampling=False)
        assert r.indices.shape == (k, 8)


# -- against DeepSpeed 0.19.8 --------------------------------------------------------------------
@pytest.mark.parametrize("name", list(fx.GATING_CASES))
def test_gating_equals_deepspeed(name):
    case, want = fx.GATING_CASES[name], FIXTURE["gating"][name]
    torch.manual_seed(case["seed"])
    r = gating.route(want["logits"].clone(), case["k"], case["cf"], case["min_cap"], used_token=want["used_token"],
                     noisy_gate_policy=case.get("noisy"), drop_tokens=case["drop"], use_rts=case.get("rts", True),
                     second_expert_sampling=case.get("sample", True))
    assert torch.allclose(r.l_aux, want["l_aux"], rtol=1e-6, atol=1e-7)
    assert torch.equal(r.exp_counts, want["exp_counts"])
    assert torch.equal(r.indices, want["indices"]) and torch.equal(r.locations, want["locations"])
    assert torch.allclose(r.weights, want["weights"], rtol=1e-6, atol=1e-7)
    # DeepSpeed's buffer may be larger than the token count; the slots past it are never used
    assert r.capacity == min(want["capacity"], case["tokens"])
    assert int(want["locations"].max()) < r.capacity


@pytest.mark.parametrize("name", list(fx.LAYER_CASES))
def test_layer_equals_deepspeed(name):
    from dslaunch.runtime.moe.layer import MoE

    want = FIXTURE["layer"][name]
    expert = torch.nn.Sequential(torch.nn.Linear(fx.H, fx.FFN), torch.nn.ReLU(), torch.nn.Linear(fx.FFN, fx.H))
    layer = MoE(fx.H, expert, num_experts=4, **fx.LAYER_CASES[name])
    layer.load_state_dict(want["state"])  # DeepSpeed's parameter names
    x = want["x"].clone().requires_grad_(True)
    torch.manual_seed(3)
    out, l_aux, counts = layer(x)
    (out.pow(2).sum() + l_aux).backward()
    assert torch.allclose(out, want["out"], atol=1e-6)
    assert torch.allclose(l_aux, want["l_aux"], atol=1e-7)
    assert torch.equal(counts, want["exp_counts"])
    assert torch.allclose(x.grad, want["x_grad"], atol=1e-6)


# -- bad input and the param-group split ----------------------------------------------------------
@pytest.mark.parametrize("kwargs,line", [
    (dict(num_experts=3, ep_size=2), "MoE: num_experts 3 is not divisible by ep_size 2"),
    (dict(num_experts=2, k=3), "MoE: k 3 is more than num_experts 2"),
    (dict(num_experts=2, noisy_gate_policy="Gumbel"),
     "MoE: noisy_gate_policy 'Gumbel' is not one of None, 'Jitter', 'RSample'"),
    (dict(num_experts=0), "MoE: num_experts 0 must be a positive integer"),
    (dict(num_experts=2, use_tutel=True), "MoE: use_tutel=True is not supported (dslaunch has no Tutel kernels); "
                                          "remove it"),
])
def test_bad_arguments_are_one_line(kwargs, line):
    from dslaunch.runtime import ConfigError
    from dslaunch.runtime.moe.layer import MoE

    with pytest.raises(ConfigError) as info:
        MoE(4, torch.nn.Linear(4, 4), **kwargs)
    assert str(info.value) == line


def test_bad_argument_in_a_script_exits_2_with_one_line():
    code = ("import torch, dslaunch.runtime\nfrom dslaunch.runtime.moe.layer import MoE\n"
            "MoE(4, torch.nn.Linear(4, 4), num_experts=4, ep_size=3)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("MoE: num_experts 4 is not divisible by ep_size 3")
    assert "Traceback" not in r.stderr


def test_split_params_into_different_moe_groups_for_optimizer():
    from dslaunch.runtime.moe.layer import MoE
    from dslaunch.runtime.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), MoE(4, torch.nn.Linear(4, 4), num_experts=4, ep_size=2))
    experts = [p for p in model.parameters() if is_moe_param(p)]
    assert len(experts) == 4  # 2 local experts x (weight, bias); the gate is not an expert parameter
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": 0.5, "weight_decay": 0.1})
    assert [(g["name"], g.get("moe", False), len(g["params"]), g["lr"]) for g in groups] == [
        ("dense", False, 3, 0.5), ("ep_size_2", True, 4, 0.5)]
    assert groups[1]["params"] == experts and groups[1]["weight_decay"] == 0.1
    cut = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "dense"}], max_group_size=20)
    assert [len(g["params"]) for g in cut[1:]] == [2, 2]  # 16 + 4 elements per expert
    with pytest.raises(ValueError, match="needs a \"name\""):
        split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters())})
