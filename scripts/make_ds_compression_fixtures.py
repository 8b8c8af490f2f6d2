"""Make tests/data/ds_compression/ with DeepSpeed 0.17.6, the last release with the compression
library (deepspeed.compression.compress):

    python3 -m venv /work/ds17-venv && /work/ds17-venv/bin/pip install torch==2.13.0 numpy \
        && DS_BUILD_OPS=0 /work/ds17-venv/bin/pip install deepspeed==0.17.6
    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ds17-ext /work/ds17-venv/bin/python \
        scripts/make_ds_compression_fixtures.py

(or DeepSpeed 0.17.6 installed with --target into a folder on PYTHONPATH of a torch 2.13 venv).
DeepSpeed's CPU accelerator builds its shared-memory comm op on first use; a folder of its own
(TORCH_EXTENSIONS_DIR) keeps that 0.17.6 build apart from a newer DeepSpeed's.

For each case of tests/compression_models.py's CASES: the model from a fixed seed,
init_compression, DeepSpeed's compression_scheduler stepped as its engine steps it (step 0
before the first forward, then after each optimizer step) around 3 SGD steps, then
redundancy_clean. One file CASE.pt per case: the initial state, the learnt scores right after
init_compression (topk methods draw them at random; the test loads them), the losses, the
cleaned state_dict and the cleaned model's output on the data.

For each of its ENGINE_CASES, at each of ENGINE_STAGES (ZeRO stages), DeepSpeed's own engine
in one process (gloo): init_compression, deepspeed.initialize, ENGINE_STEPS steps of Adam,
redundancy_clean. One file engine.pt: per case and stage the same items as above, and the
pruning masks as trained (before redundancy_clean).
tests/runtime/train/test_compression.py runs the same with dslaunch.
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import deepspeed  # noqa: E402
from deepspeed.compression.compress import init_compression, redundancy_clean  # noqa: E402
from deepspeed.compression.config import get_compression_config  # noqa: E402
from deepspeed.compression.constants import SHARED_PARAMETERS, SPARSE_PRUNING  # noqa: E402
from deepspeed.compression.scheduler import compression_scheduler  # noqa: E402

import compression_models as cm  # noqa: E402

OUT = os.path.join(HERE, "..", "tests", "data", "ds_compression")
SCORES = ("sparse_mask_scores", "row_mask_scores", "head_pruning_scores", "channel_mask_scores")


def run(name):
    cls, section = cm.CASES[name]
    config = {"train_batch_size": 1, "compression_training": section}
    model = cm.fresh(cls)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    init_compression(model, config)
    scores = _scores(model)
    parsed = get_compression_config(config)
    # 0.17.6 reads schedule_offset_end for snip_momentum only, and its scheduler then fails on
    # the missing key for l1/topk: give it the documented default (schedule_offset)
    shared = parsed["sparse_pruning"]["shared_parameters"]
    shared.setdefault("schedule_offset_end", shared["schedule_offset"])
    scheduler = compression_scheduler(model, parsed)
    x, y = cm.data(cls)

    def on_step(k):
        scheduler.step(step_zero_check=(k == 0))

    losses = cm.train(model, x, y, on_step)
    redundancy_clean(model, config)
    cleaned = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        output = model(x)  # in training mode, as the test runs it: batch norm updates its statistics
    return {"deepspeed": deepspeed.__version__, "initial": initial, "scores": scores, "losses": losses,
            "cleaned": cleaned, "output": output}


def layer_reduction():
    """A 2-layer student initialised from layers 1 and 3 (and emb, head) of a 4-layer teacher."""
    config = {"train_batch_size": 1, "compression_training": cm.LAYER_REDUCTION}
    teacher = cm.fresh(cm.Stack)
    torch.manual_seed(1)
    student = cm.Stack(2)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    init_compression(student, config, teacher_model=teacher)
    x, _ = cm.data(cm.MLP)
    with torch.no_grad():
        output = student(x)
    return {"deepspeed": deepspeed.__version__, "teacher": teacher.state_dict(), "student_before": before,
            "student": student.state_dict(), "output": output}


def _scores(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith(SCORES)}


def _masks(model):
    """Every pruning mask of the model as trained ("fc2.row": the mask, flattened), before
    redundancy_clean bakes them in: which weights, rows and heads were kept."""
    out = {}
    for name, module in model.named_modules():
        for kind, method in (("sparse", "sparse_pruning_method"), ("row", "row_pruning_method"),
                             ("head", "head_pruning_method")):
            if getattr(module, method, None) is not None:
                out[f"{name}.{kind}"] = module.get_mask(pruning_type=kind).detach().flatten().clone()
    return out


def engine_run(case, stage):
    """One ENGINE_CASES case through DeepSpeed's engine at ZeRO `stage`."""
    config = cm.engine_config(case, stage)
    model = cm.engine_model(case)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    init_compression(model, config)
    scores = _scores(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    sparse = engine.compression_scheduler.different_compression_methods[SPARSE_PRUNING][SHARED_PARAMETERS]
    # as in run(): the key 0.17.6's scheduler reads for sparse pruning but its parser fills for
    # snip_momentum only (one-shot pruning at schedule_offset)
    sparse.setdefault("schedule_offset_end", sparse.get("schedule_offset"))
    x, y = cm.engine_data()
    losses = cm.engine_train(engine, x, y)
    masks = _masks(model)
    redundancy_clean(model, cm.engine_config(case, stage))
    cleaned = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        output = model(x)
    return {"initial": initial, "scores": scores, "losses": losses, "masks": masks, "cleaned": cleaned,
            "output": output}


def engine_cases():
    from bench_ranks import free_port  # scripts/, on sys.path when run as a script

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"deepspeed": deepspeed.__version__, "cases": {}}
    for case in cm.ENGINE_CASES:
        for stage in cm.ENGINE_STAGES:
            out["cases"][f"{case}/zero{stage}"] = engine_run(case, stage)
            print("ran", case, "at ZeRO", stage)
    return out


def main():
    assert deepspeed.__version__.startswith("0.17."), deepspeed.__version__
    os.makedirs(OUT, exist_ok=True)
    for name in cm.CASES:
        torch.save(run(name), os.path.join(OUT, f"{name}.pt"))
        print("wrote", name)
    torch.save(layer_reduction(), os.path.join(OUT, "layer_reduction.pt"))
    print("wrote layer_reduction")
    torch.save(engine_cases(), os.path.join(OUT, "engine.pt"))
    print("wrote engine")


if __name__ == "__main__":
    main()
