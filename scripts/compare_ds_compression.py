"""How far dslaunch's compression is from DeepSpeed 0.17.6 on the engine cases:

    .venv/bin/python scripts/compare_ds_compression.py

For each case of tests/compression_models.py's ENGINE_CASES at each ZeRO stage, dslaunch's
engine replays the run that scripts/make_ds_compression_fixtures.py recorded with DeepSpeed
0.17.6 (tests/data/ds_compression/engine.pt): the same initial weights and learnt scores,
init_compression, deepspeed.initialize, the training steps, redundancy_clean. Prints, per run,
the largest relative difference of the losses, the largest absolute difference of the cleaned
weights and of the cleaned model's output, and whether the pruning masks as trained (which
weights, rows and heads were kept) and the cleaned shapes are the same.
tests/runtime/train/test_compression.py asserts the same comparison (`replay`).
No DeepSpeed is needed.
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
FIXTURE = os.path.join(TESTS, "data", "ds_compression", "engine.pt")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import compression_models as cm  # noqa: E402

# DeepSpeed's names of the learnt scores -> the kind of our technique that holds them
SCORE_KINDS = {"sparse_mask_scores": "sparse", "row_mask_scores": "row", "head_pruning_scores": "head",
               "channel_mask_scores": "channel"}


def load_scores(model, scores) -> None:
    """Copy DeepSpeed's learnt scores (drawn at random by its init_compression) into ours."""
    from dslaunch.runtime.compression import compression_schedule

    parts = {(p.target.name, getattr(p.technique, "kind", None)): p.technique
             for p in compression_schedule(model).parts}
    for key, value in scores.items():
        module, _, name = key.rpartition(".")
        parts[(module, SCORE_KINDS[name])].scores.data.copy_(value)


def replay(case: str, stage: int, ref: dict) -> dict:
    """dslaunch's run of ENGINE_CASES[case] at ZeRO `stage` from DeepSpeed's initial weights and
    scores (`ref`, the fixture's entry). Starts the engine in this process."""
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.compression import compression_schedule, init_compression, redundancy_clean

    config = cm.engine_config(case, stage)
    model = cm.MLP3()
    model.load_state_dict(ref["initial"])
    init_compression(model, config)
    load_scores(model, ref["scores"])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = cm.engine_data()
    losses = cm.engine_train(engine, x, y)
    masks = {f"{p.target.name}.{p.technique.kind}": p.technique.current().detach().flatten().clone()
             for p in compression_schedule(model).parts
             if getattr(p.technique, "kind", None) in ("sparse", "row", "head")}
    redundancy_clean(model, config)
    with torch.no_grad():
        output = model(x)
    return {"losses": losses, "masks": masks,
            "cleaned": {k: v.detach().clone() for k, v in model.state_dict().items()}, "output": output}


def differences(ours: dict, ref: dict) -> dict:
    """The largest differences between a replay and DeepSpeed's run."""
    same_masks = sorted(ours["masks"]) == sorted(ref["masks"]) and all(
        torch.equal(ours["masks"][k], v) for k, v in ref["masks"].items()) and \
        sorted(ours["cleaned"]) == sorted(ref["cleaned"]) and all(
            ours["cleaned"][k].shape == v.shape for k, v in ref["cleaned"].items())
    weights = max((ours["cleaned"][k] - v).abs().max().item() for k, v in ref["cleaned"].items()) \
        if same_masks else float("nan")
    loss = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ref["losses"]))
    output = (ours["output"] - ref["output"]).abs().max().item() if same_masks else float("nan")
    return {"loss_rel": loss, "weights_abs": weights, "output_abs": output, "same_masks": same_masks}


def main() -> None:
    fixture = torch.load(FIXTURE)
    print(f"dslaunch against DeepSpeed {fixture['deepspeed']} ({os.path.relpath(FIXTURE)}), "
          f"{cm.ENGINE_STEPS} steps, torch {torch.__version__}")
    print(f"{'case':<18} {'ZeRO':>4} {'loss (rel)':>11} {'weights':>9} {'output':>9}  masks")
    for case in cm.ENGINE_CASES:
        for stage in cm.ENGINE_STAGES:
            ref = fixture["cases"][f"{case}/zero{stage}"]
            d = differences(replay(case, stage, ref), ref)
            print(f"{case:<18} {stage:>4} {d['loss_rel']:>11.2e} {d['weights_abs']:>9.2e} {d['output_abs']:>9.2e}  "
                  f"{'same' if d['same_masks'] else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
