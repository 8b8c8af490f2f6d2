"""The compression branch of the generated differential test (scripts/diff_compression.py),
against DeepSpeed 0.17.6: the cases the seed draws, replayed on our side against DeepSpeed's
recorded answers in tests/data/ds_diff_compression/ (no DeepSpeed needed): in CI EXTRA_CASES
and a fixed share of the drawn cases (ci_cases), every recorded one under DIFF_ALL=1. An
unlisted divergence or refusal fails, and so does a listed divergence that stops diverging,
and a generated case without a record."""
from __future__ import annotations

import collections
import os
import sys

import pytest
import repo_paths

sys.path.insert(0, str(repo_paths.SCRIPTS))

import diff_compression as dc  # noqa: E402
import diff_compression_cases as cases_mod  # noqa: E402
import diff_report  # noqa: E402
from diff_compression_cases import CompCase, classify  # noqa: E402


@pytest.fixture(scope="module")
def fixtures():
    return dc.load_fixtures()


def test_every_generated_case_has_deepspeeds_answer(fixtures):
    cases = cases_mod.generate()
    missing = [c.line for c in cases if c.line not in fixtures]
    assert not missing, f"generated cases without a DeepSpeed 0.17.6 record (--record --missing): {missing[:5]}"
    assert 60 <= len(cases) <= 150
    import torch

    recorded_by = torch.load(dc.RESULTS, weights_only=True)["deepspeed"]
    assert recorded_by.startswith("0.17."), f"the fixtures name DeepSpeed {recorded_by!r}, not 0.17.x"


def test_the_grammar_covers_every_technique_offset_and_related_modules():
    """Every technique both sides have, at every schedule offset 0-3, with and without its
    related modules, at ZeRO 0 and 2, on every model; layer reduction from every teacher
    layer choice."""
    cases = cases_mod.generate()
    for t in ("sparse", "row", "head", "channel", "wq", "aq"):
        offsets = {getattr(c, f"{t}_at") for c in cases if getattr(c, t) != "none"}
        assert offsets == {0, 1, 2, 3}, (t, offsets)
    for t in ("row", "head", "channel"):
        assert {getattr(c, f"{t}_rel") for c in cases if getattr(c, t) != "none"} == {False, True}, t
    for t in ("sparse", "row", "channel"):
        assert {getattr(c, t) for c in cases} >= {"l1", "topk"}, t
    assert {c.stage for c in cases} >= {0, 2} and {c.model for c in cases} == set(cases_mod.MODELS)
    assert {c.reduce for c in cases if c.reduce != "none"} == set(cases_mod.TEACHER_LAYERS)  # layer reduction
    assert {c.clip for c in cases} == {0.0, 1.0}


def test_case_lines_read_back():
    for case in cases_mod.generate():
        assert CompCase.parse(case.line) == case
    with pytest.raises(ValueError, match="not key=value"):
        CompCase.parse("model=mlp rows=l1")
    with pytest.raises(ValueError, match="no target"):
        CompCase.parse("model=mlp channel=l1")


def test_the_classifier_separates_the_classes():
    case = CompCase(row="l1")
    ran = {"losses": [1.0, 0.5], "shapes": {"w": [2, 2]}, "weights": {"w": [0.25, 0.0, 1.0, -0.5]}}
    tol = cases_mod.TOLERANCES["fp32"]
    assert classify(case, ran, dict(ran)).kind == "equal"
    assert classify(case, ran, dict(ran, losses=[1.0, 0.5 * (1 + 0.5 * tol.rtol)])).kind == "equal"
    assert classify(case, ran, dict(ran, losses=[1.0, 0.5 * (1 + 3 * tol.rtol) + tol.atol])).kind == "divergence"
    assert classify(case, ran, dict(ran, shapes={"w": [1, 2]})).kind == "divergence"
    assert classify(case, ran, dict(ran, weights={"w": [0.25, 1e-3, 1.0, -0.5]})).kind == "divergence"
    refusal = {"error": "ConfigError: x", "lines": 1}
    ds_refusal = {"error": "NotImplementedError: ", "lines": 1}
    assert classify(case, ds_refusal, refusal).kind == "refused by both"
    assert classify(case, ds_refusal, dict(refusal, lines=2)).kind == "divergence"
    assert classify(case, ds_refusal, ran).kind == "refused by DeepSpeed only"
    assert classify(case, ran, refusal).kind == "divergence"  # not a listed gap
    falling = CompCase(wq="sym", wq_bits=4, wq_start=8)
    assert classify(falling, ran, dict(ran, losses=[1.0, 0.6])).kind == "different by design (listed)"
    assert classify(falling, ran, dict(ran)).kind == "equal"


def ci_cases(fixtures):
    """Every recorded case under DIFF_ALL=1; otherwise EXTRA_CASES, every listed case (OPEN,
    and those DESIGN covers, so that a healed one is noticed) and a fixed share of the drawn
    cases, picked by a hash of their line (a new case does not reshuffle the others)."""
    cases = cases_mod.generate()
    keep = {CompCase.parse(line).line for line in cases_mod.EXTRA_CASES} | set(cases_mod.OPEN)
    keep |= {c.line for c in cases if cases_mod.design_reason(c)}
    return diff_report.replayed(cases, fixtures, keep, CI_DRAWN, every=os.environ.get("DIFF_ALL") == "1")


CI_DRAWN = 24  # drawn cases replayed in CI (with the kept ones); DIFF_ALL=1 replays all of them


def test_replay_generated_cases(fixtures):
    """Our side of the generated cases against DeepSpeed 0.17.6's answers: no divergence, no
    refusal of ours that GAPS does not list, and no listed divergence that stopped diverging."""
    cases = ci_cases(fixtures)
    _, verdicts = dc.compare(cases, fixtures)
    print(diff_report.summary(cases, fixtures, verdicts, cases_mod.CLASSES))
    bad = diff_report.divergences(verdicts)
    assert not bad, f"{len(bad)} divergences from DeepSpeed 0.17.6:\n" + "\n".join(bad[:20])
    healed = diff_report.healed(verdicts, cases_mod.OPEN)
    assert not healed, f"listed in OPEN but no longer diverging: {healed}"
    by_design = [line for line, v in verdicts.items()
                 if cases_mod.design_reason(CompCase.parse(line)) and v.kind == "equal"]
    assert not by_design, f"DESIGN says these differ from DeepSpeed, but they do not: {by_design}"
    counts = collections.Counter(v.kind for v in verdicts.values())
    assert sum(counts.values()) == len(cases)
