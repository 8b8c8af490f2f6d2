"""The Hugging Face Trainer on dslaunch: `TrainingArguments(deepspeed=...)` under
`dslaunch --num_gpus 2`, through the `deepspeed` compatibility package (built by pip).

One set of jobs (tests/workers/hf_trainer_job.py, a tiny GPT-2 from save_pretrained, 4
optimizer steps of micro batch 2 x accumulation 2 on 2 ranks, fp32) is shared by the tests:
the Trainer's own DDP run, ZeRO-2, ZeRO-3 (model built inside zero.Init by from_pretrained),
ZeRO-3 resumed from the ZeRO-3 run's step-2 checkpoint, and evaluate() without training under
DDP and ZeRO-3.
"""
import json
import os
import subprocess

import pytest
import torch
import repo_paths

HERE = str(repo_paths.TESTS)
JOB = os.path.join(HERE, "workers", "hf_trainer_job.py")
TOL = 1e-5


def _dslaunch(env, *args, timeout=240):
    return subprocess.run(["dslaunch", "--num_gpus", "2", "--master_port", "0", *args], env=env, cwd=HERE,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def runs(deepspeed_compat, tiny_gpt2, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_trainer")
    env = deepspeed_compat.env()
    results = {}
    for name, mode, extra in [("ddp", "ddp", []), ("zero2", "zero2", []), ("zero3", "zero3", []),
                              ("zero3_resumed", "zero3", ["--resume", str(out / "zero3" / "checkpoint-2")]),
                              ("ddp_eval", "ddp", ["--evaluate_only"]), ("zero3_eval", "zero3", ["--evaluate_only"])]:
        res = _dslaunch(env, JOB, "--mode", mode, "--model", str(tiny_gpt2), "--out", str(out / name), *extra)
        assert res.returncode == 0, f"{name}: {res.stderr[-4000:]}"
        with open(out / name / "result.json") as fh:
            results[name] = json.load(fh)
        results[name]["dir"] = out / name
        if (out / name / "final_weights.pt").exists():
            results[name]["weights"] = torch.load(out / name / "final_weights.pt")
    return results


def _max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_trainer_losses_and_weights_equal_the_trainers_ddp_run(runs, mode):
    ddp, run = runs["ddp"], runs[mode]
    assert run["engine"] == "dslaunch.runtime.train.engine.DeepSpeedEngine"
    assert sorted(run["losses"]) == ["1", "2", "3", "4"]
    for step, loss in ddp["losses"].items():
        assert abs(run["losses"][step] - loss) <= TOL, (step, run["losses"], ddp["losses"])
    assert _max_diff(run["weights"], ddp["weights"]) <= TOL
    assert abs(run["evals"]["after"] - ddp["evals"]["after"]) <= TOL  # evaluate() on the trained engine


def test_zero3_from_pretrained_builds_the_model_sharded(runs):
    # TrainingArguments(deepspeed=ZeRO-3 config) came first: from_pretrained ran inside
    # deepspeed.zero.Init, so every weight was a shard from the start, the 1-D biases and
    # LayerNorms too (DeepSpeed's Init cuts them all; its engine, and ours, makes those under
    # stage3_param_persistence_threshold whole again when it takes the model).
    sharded = runs["zero3"]["sharded_at_load"]
    assert "transformer.wte.weight" in sharded and "transformer.h.0.attn.c_attn.weight" in sharded
    assert "transformer.h.0.ln_1.weight" in sharded


@pytest.mark.skipif(torch.cuda.is_available(), reason="the recipe is for machines without a GPU")
def test_without_the_cpu_recipe_the_error_names_the_cause_and_the_fix(deepspeed_compat, tiny_gpt2, tmp_path):
    res = _dslaunch(deepspeed_compat.env(), JOB, "--mode", "zero2", "--model", str(tiny_gpt2), "--out",
                    str(tmp_path), "--no_cpu_recipe")
    assert res.returncode == 2, res.stderr[-3000:]
    assert ('error: batch size: train_batch_size 4 = 2 x 2 x 1 was filled in ("auto") for a world of 1 process, '
            "but this is data-parallel size 2") in res.stderr
    assert 'accelerate.PartialState(backend="gloo")' in res.stderr and "Traceback" not in res.stderr


def test_zero3_parameters_carry_deepspeeds_attributes_so_the_trainer_counts_them_all(runs):
    # get_model_param_count is what Trainer.train() logs as "Number of trainable parameters"
    ddp, zero3 = runs["ddp"]["counted"], runs["zero3"]["counted"]
    assert zero3["trainable"] == ddp["trainable"] > 10_000
    assert zero3["status"] == ["NOT_AVAILABLE"]  # ds_status of every sharded parameter at rest
    assert ddp["status"] == [] and zero3["shapes_match"]
    assert zero3["ids"] == runs["zero3"]["parameters"]  # one ds_id each
    assert runs["zero3_eval"]["counted"]["trainable"] == ddp["trainable"]


def test_zero3_save_model_writes_a_full_model_that_from_pretrained_loads(runs):
    from transformers import AutoModelForCausalLM

    final = runs["zero3"]["dir"] / "final"
    assert "model.safetensors" in runs["zero3"]["saved"]
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    loaded = model.state_dict()
    assert _max_diff({k: loaded[k] for k in runs["ddp"]["weights"]}, runs["ddp"]["weights"]) <= TOL
    ids = torch.arange(16)[None] % 64
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_trainer_checkpoint_resumes_with_the_uninterrupted_runs_losses(runs):
    full, resumed = runs["zero3"], runs["zero3_resumed"]
    assert full["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    # Trainer's checkpoint folder holds the engine's checkpoint under DeepSpeed's tag name
    assert (full["dir"] / "checkpoint-2" / "global_step2").is_dir()
    assert sorted(resumed["losses"]) == ["3", "4"]
    for step in ("3", "4"):
        assert abs(resumed["losses"][step] - full["losses"][step]) <= TOL
    assert _max_diff(resumed["weights"], full["weights"]) <= TOL


def test_zero3_evaluate_without_training_runs_a_forward_only_engine(runs):
    # evaluate() with no train(): the Trainer builds the engine with no optimizer (ZeRO inference);
    # this job runs the HF DeepSpeed guide's ZeRO-3 config as users copy it (CPU offload included)
    got = runs["zero3_eval"]
    assert abs(got["evals"]["before"] - runs["ddp_eval"]["evals"]["before"]) <= TOL
    assert "transformer.wte.weight" in got["sharded_at_load"]

