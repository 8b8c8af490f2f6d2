"""deepspeed.runtime.rollout through dslaunch.runtime: the answers DeepSpeed 0.19.8 recorded
(scripts/make_ds_rollout_fixtures.py) for the distillation loss, the response targets and
generate() over a stand-in module, and the one-line refusals of what is not provided."""
import json
import types

import pytest
import torch

import dslaunch.runtime  # noqa: F401  (installs the alias table)
from dslaunch.runtime import rollout
from dslaunch.runtime.rollout import hybrid_engine_rollout as hybrid
from repo_paths import DATA
from script_modules import load_script

RECORDED = json.loads((DATA / "ds_rollout" / "expected.json").read_text())
maker = load_script("make_ds_rollout_fixtures")


@pytest.fixture(scope="module")
def ours():
    return maker.answer(rollout, hybrid, RECORDED["inputs"])


def test_jsd_loss_matches_deepspeed(ours):
    for got, want in zip(ours["jsd"], RECORDED["expected"]["jsd"], strict=True):
        assert got["count"] == want["count"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        assert got["loss_sum"] == pytest.approx(want["loss_sum"], rel=1e-5, abs=1e-6)


def test_response_targets_match_deepspeed(ours):
    assert ours["responses"] == RECORDED["expected"]["responses"]


def test_generate_matches_deepspeed(ours):
    # the batch (response cut at its first EOS, masks) and what module.generate was asked for
    assert ours["generate"] == RECORDED["expected"]["generate"]


def test_paths_are_one_package():
    assert rollout.HybridEngineRollout is hybrid.HybridEngineRollout
    assert rollout.build_rollout(rollout.RolloutConfig(), student_engine=object(),
                                 tokenizer=types.SimpleNamespace()).name == "hybrid_engine"
    with pytest.raises(ValueError, match="Unknown rollout engine 'vllm'"):
        rollout.build_rollout(rollout.RolloutConfig(engine="vllm"))


def test_top_p_keeps_the_nucleus():
    torch.manual_seed(0)
    # probabilities 0.5, 0.3, 0.2: top_p 0.6 keeps the first two (the one crossing 0.6 included)
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(400, 1)
    drawn = rollout.HybridEngineRollout._sample_top_p(logits, temperature=1.0, top_p=0.6)
    assert drawn.shape == (400, 1) and set(drawn.flatten().tolist()) == {0, 1}
    assert set(rollout.HybridEngineRollout._sample_top_p(logits, top_p=1.0).flatten().tolist()) == {0, 1, 2}
    assert rollout.HybridEngineRollout._sample_top_p(logits[:1], top_p=0.4).item() == 0


def _engine():
    return types.SimpleNamespace(module=maker.StandIn([[4, 4]]))


def test_refusals_are_one_line():
    tok = types.SimpleNamespace(pad_token_id=0, eos_token_id=2)
    request = rollout.RolloutRequest(prompt_ids=torch.tensor([[5, 6]]), prompt_attention_mask=torch.ones(1, 2))
    graph = rollout.HybridEngineRollout(_engine(), tok, cfg=hybrid.HybridEngineRolloutConfig(use_graph_capture=True))
    with pytest.raises(ValueError, match="CUDA-graph greedy decoder is not provided") as err:
        graph.generate(request, rollout.SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert "\n" not in str(err.value)
    # sampling never reads use_graph_capture, so it still generates
    assert graph.generate(request, rollout.SamplingConfig(max_new_tokens=2)).seq_len == 4
    with pytest.raises(ValueError, match="continuous batching"):
        graph.generate(request, rollout.SamplingConfig(max_new_tokens=2, continuous_batch_size=4))
    for key, value in (("enable_profiling", True), ("use_shared_prefill", True), ("align_decode_fronts", True),
                       ("enable_cache_trimming", True), ("continuous_cache_capacity", 64)):
        with pytest.raises(ValueError, match=key):
            rollout.HybridEngineRollout(_engine(), tok, cfg=hybrid.HybridEngineRolloutConfig(**{key: value}))
