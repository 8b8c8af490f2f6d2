"""The generated differential test against DeepSpeed 0.19.8 (scripts/diff_vs_deepspeed.py):
the cases the seed draws, replayed on our side against DeepSpeed's recorded answers in
tests/data/ds_diff/ (no DeepSpeed needed): in CI a fixed share of them (ci_cases), every
recorded one under DIFF_ALL=1. A divergence or an unlisted refusal fails, and so do fewer
than 500 recorded cases or a line of EXTRA_CASES without a record."""
from __future__ import annotations

import collections
import os
import sys

import pytest
import repo_paths
import torch

sys.path.insert(0, str(repo_paths.SCRIPTS))

import diff_cases  # noqa: E402
import diff_report  # noqa: E402
import diff_vs_deepspeed as dvd  # noqa: E402
from diff_cases import Case, classify, equivalent  # noqa: E402


@pytest.fixture(scope="module")
def fixtures():
    return dvd.load_fixtures()


def test_the_generated_cases_have_deepspeeds_answers(fixtures):
    """At least 500 generated cases are recorded under DeepSpeed, the regression lines of
    EXTRA_CASES all of them; docs/deepspeed-differential.md counts any drawn case still
    without a record ('not recorded under DeepSpeed': scripts/diff_vs_deepspeed.py --record
    --missing records them)."""
    cases = diff_cases.generate()
    recorded = [c for c in cases if c.line in fixtures]
    assert len(recorded) >= 500, f"{len(recorded)} of {len(cases)} generated cases have a DeepSpeed record"
    extra = [Case.parse(line).line for line in diff_cases.EXTRA_CASES]
    missing = [line for line in extra if line not in fixtures]
    assert not missing, f"EXTRA_CASES without a DeepSpeed record (--record --missing): {missing}"


def test_case_lines_read_back():
    for case in diff_cases.generate():
        assert Case.parse(case.line) == case
    with pytest.raises(ValueError, match="not key=value"):
        Case.parse("model=mlp wrld=2")
    with pytest.raises(ValueError, match="world must be"):
        Case.parse("model=moe world=3 ep=2")


def test_the_classifier_separates_the_classes():
    case = Case()
    ran = {"losses": [1.0, 0.5], "eval": [], "global_steps": 2, "skipped_steps": 0, "weight_names": ["w", "b"],
           "weight_sizes": [3, 1], "weights": [0.25, -0.5, 1.0, 0.125]}
    tol = diff_cases.TOLERANCES["fp32"]
    listed = lambda message: "is not supported" in message  # noqa: E731
    assert classify(case, ran, dict(ran), listed).kind == "equal"
    nudged = dict(ran, losses=[1.0, 0.5 + 0.5 * tol.rtol * 0.5])
    assert classify(case, ran, nudged, listed).kind == "equal"
    off = dict(ran, losses=[1.0, 0.5 * (1 + 3 * tol.rtol) + tol.atol])
    assert classify(case, ran, off, listed).kind == "divergence"
    assert classify(case, ran, dict(ran, weights=[0.25, -0.5, 1.0, 0.126]), listed).kind == "divergence"
    assert classify(case, ran, dict(ran, weights=[0.25, -0.5, 1.0 + 1e-5, 0.125]), listed).kind == "equal"
    assert classify(case, ran, dict(ran, weight_names=["w", "c"]), listed).kind == "divergence"
    assert classify(case, ran, dict(ran, skipped_steps=1), listed).kind == "divergence"
    refusal = {"error": "ConfigError: x: this is not supported; remove it", "lines": 1}
    assert classify(case, ran, refusal, listed).kind == "refused here only (listed)"
    assert classify(case, ran, {"error": "KeyError: 'x'", "lines": 1}, listed).kind == "divergence"
    assert classify(case, ran, dict(refusal, lines=3), listed).kind == "divergence"
    ds_refusal = {"error": "AssertionError: no", "lines": 1}
    assert classify(case, ds_refusal, refusal, listed).kind == "refused by both"
    assert classify(case, ds_refusal, ran, listed).kind == "refused by DeepSpeed only"
    # where DeepSpeed refuses or is wrong, its answer to an equivalent case stands in
    fp16 = Case(dtype="fp16")
    twin, rules = equivalent(fp16)
    # stage 0 fp16 -> stage 1, then its growing dynamic scale -> the static scale it starts at
    assert twin == Case(dtype="fp16", stage=1, allow_untested=True, loss_scale=256)
    assert len(rules) == 2 and all(r.wrong for r in rules)
    assert classify(fp16, dict(ran, losses=[1.0, 0.9]), ran, listed, twin=ran, rules=rules).kind == \
        "equal to an equivalent case"
    assert classify(fp16, ran, dict(ran, losses=[1.0, 0.9]), listed, twin=ran, rules=rules).kind == "divergence"
    assert classify(fp16, ran, ran, listed, twin=ds_refusal, rules=rules).kind == "DeepSpeed wrong, no equivalent"
    assert classify(fp16, ds_refusal, ran, listed, twin=None, rules=rules).kind == "refused by DeepSpeed only"


def test_listed_reasons_come_from_the_config_page():
    reasons = dvd.listed_reasons()
    # a refused key of the config-key table, and a refused combination of the list below it
    assert "graph harvesting is not supported (DeepSpeed removed it too); remove it" in reasons
    assert dvd.is_listed("ConfigError: graph_harvesting: graph harvesting is not supported (DeepSpeed removed it "
                         "too); remove it", reasons)
    assert dvd.is_listed('ConfigError: x: "moe" param groups need ZeRO stage 0, 1 or 2 without offload', reasons)
    assert not dvd.is_listed("KeyError: 'x'", reasons)


@pytest.mark.parametrize("cfg", [
    {"prescale_gradients": True, "gradient_predivide_factor": 2.0},
    {"gradient_allreduce_op": "sum", "prescale_gradients": True},
    {"gradient_allreduce_op": "SUM", "gradient_predivide_factor": 2.0},
    {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 0}},
])
def test_refused_combinations_end_in_a_listed_reason(cfg):
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.strict import ConfigError

    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.load({"train_batch_size": 2, **cfg})
    assert dvd.is_listed(str(err.value), dvd.listed_reasons()), str(err.value)


def both_sources_body():
    """initialize() given an optimizer (or scheduler) both ways: the refusal's line."""
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.strict import ConfigError

    lines = []
    for kind in ("optimizer", "scheduler"):
        model = torch.nn.Linear(2, 2)
        cfg = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        kw = {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
        if kind == "scheduler":
            cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
            kw = {"lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)}
        try:
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, **kw)
            lines.append(None)
        except ConfigError as err:
            lines.append(str(err))
    return lines


def test_an_optimizer_or_scheduler_given_both_ways_is_refused_for_a_listed_reason():
    """DeepSpeed 0.19.8 takes the passed optimizer or scheduler and silently drops the config's
    section; here the pair is refused in one line, and the refused-combinations list gives why."""
    from dist_harness import run_function

    lines = run_function(both_sources_body, nprocs=1, timeout=120)[0]
    assert lines == ["optimizer: given both as initialize(optimizer=...) and in the config; pass one",
                     "scheduler: given both as initialize(lr_scheduler=...) and in the config; pass one"]
    reasons = dvd.listed_reasons()
    assert all(dvd.is_listed("ConfigError: " + line, reasons) for line in lines)


def ci_cases(fixtures):
    """What the test replays: every case under DIFF_ALL=1 (scripts/diff_vs_deepspeed.py does
    the same and prints the table docs/deepspeed-differential.md shows); otherwise EXTRA_CASES
    and a fixed share of the drawn cases, picked by a hash of their line (so a new case does
    not reshuffle the others), small enough for CI's two cores."""
    extra = {Case.parse(line).line for line in diff_cases.EXTRA_CASES}
    return diff_report.replayed(diff_cases.generate(), fixtures, extra, CI_DRAWN,
                                every=os.environ.get("DIFF_ALL") == "1")


CI_DRAWN = 36  # drawn cases replayed in CI (with the EXTRA_CASES); DIFF_ALL=1 replays all of them


def test_replay_generated_cases(fixtures):
    """Our side of the generated cases, against DeepSpeed's answer: no divergence, and every
    refusal DeepSpeed does not make is listed in docs/configuration.md."""
    cases = ci_cases(fixtures)
    _, verdicts = dvd.compare(cases, fixtures)
    counts = collections.Counter(v.kind for v in verdicts.values())
    print(diff_report.summary(cases, fixtures, verdicts, diff_cases.CLASSES))
    bad = diff_report.divergences(verdicts)
    assert not bad, f"{len(bad)} divergences from DeepSpeed:\n" + "\n".join(bad[:20])
    healed = diff_report.healed(verdicts, diff_cases.OPEN)
    assert not healed, f"listed as open divergences in diff_cases.OPEN but no longer diverging: {healed}"
    agreeing = diff_report.healed(verdicts, diff_cases.DEEPSPEED_WRONG, kind="DeepSpeed wrong, no equivalent")
    assert not agreeing, f"listed in diff_cases.DEEPSPEED_WRONG but agreeing with DeepSpeed now: {agreeing}"
    assert sum(counts.values()) == len(cases)
