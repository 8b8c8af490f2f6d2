"""deepspeed.moe.sharded_moe's gating functions (dslaunch.runtime.moe.sharded) against
DeepSpeed 0.19.8's returns for the same calls and seeds, recorded in tests/data/ds_sharded_moe.pt
by scripts/make_ds_sharded_moe_fixtures.py (the calls: scripts/ds_sharded_moe_cases.py)."""
import importlib
import sys

import pytest
import torch

import dslaunch.runtime  # noqa: F401  installs the alias table

from repo_paths import DATA, SCRIPTS  # noqa: E402

sys.path.insert(0, str(SCRIPTS))
from ds_sharded_moe_cases import run  # noqa: E402

DS = torch.load(DATA / "ds_sharded_moe.pt")
sharded_moe = importlib.import_module("dslaunch.runtime.moe.sharded_moe")
OURS = run(sharded_moe)


def test_recorded_from_deepspeed_0_19_8():
    assert DS["deepspeed"] == "0.19.8"
    assert sorted(OURS) == sorted(DS["results"])


@pytest.mark.parametrize("case", sorted(DS["results"]))
def test_gating_equals_deepspeeds(case):
    want, got = DS["results"][case], OURS[case]
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


def test_dense_and_sparse_dispatch_agree():
    torch.manual_seed(0)
    logits, hidden = torch.randn(16, 4), torch.randn(16, 8)
    dense = sharded_moe.topkgating(logits, 3, 1.0, 0)
    _, cap, e, idx, loc, gates, _ = sharded_moe.topkgating(logits, 3, 1.0, 0, sparse_routes=True)
    slots = sharded_moe._route_slots(idx, loc, e, int(cap))
    buf = sharded_moe._sparse_encode(hidden, slots, e, int(cap))
    torch.testing.assert_close(buf, torch.einsum("sec,sm->ecm", dense[2].float(), hidden))
    out = torch.randn_like(buf)
    torch.testing.assert_close(sharded_moe._sparse_decode(out.view(-1, 8), slots, gates, 16),
                               torch.einsum("sec,ecm->sm", dense[1], out))


def test_refusals_are_one_line():
    with pytest.raises(ValueError, match="Invalid drop_policy: random"):
        sharded_moe.topkgating(torch.randn(4, 2), 1, 1.0, 0, drop_policy="random")
    with pytest.raises(ValueError, match="3 tokens are fewer than min_capacity 4"):
        sharded_moe.top1gating(torch.randn(3, 2), 1.0, 4)
    with pytest.raises(ValueError, match="use_tutel"):
        sharded_moe.top1gating(torch.randn(4, 2), 1.0, 0, use_tutel=True)


def test_no_drop_without_a_group_makes_no_collective(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("no collective without an expert-parallel group")

    monkeypatch.setattr(sharded_moe.dist, "all_reduce", fail)
    monkeypatch.setattr(sharded_moe.dist, "get_world_size", fail)
    _, combine, _, counts = sharded_moe.top2gating(torch.randn(8, 4), 1, 0, drop_tokens=False,
                                                   top2_2nd_expert_sampling=False)
    assert combine.shape[-1] == int(counts.max())


def test_the_moe_layer_exchanges_through_deepspeeds_all_to_all():
    # DeepSpeed's tests and scripts patch sharded_moe._AllToAll.apply to watch a layer's exchanges
    layer = importlib.import_module("dslaunch.runtime.moe.layer")
    assert layer._AllToAll is sharded_moe._AllToAll
