"""Pipeline scripts as users run them, on ranks started like a launcher starts them.

The seed's GPT-lite pipeline script (scripts/examples/gptlite_pipeline.py) trains on 2 ranks
as 2 stages, reading its data from initialize(training_data=) on the first and last stage.

A pipeline used in a way it cannot run stops every rank with one line on stderr and exit
status 2, never a traceback or a hang: a small script with the problem in it.

The script synchronises the ranks (a barrier) before the bad call, so that all of them reach
it together and each one's own exit status is seen (the harness stops the others shortly
after one rank fails)."""
import json
import os

import pytest

from dist_harness import run_script
import repo_paths

ROOT = str(repo_paths.ROOT)
EXAMPLE = os.path.join(ROOT, "scripts", "examples")

SCRIPT = r'''
import sys

import torch
import torch.distributed as dist
import dslaunch.runtime as deepspeed

case = sys.argv[1]
deepspeed.init_distributed()
dist.barrier()
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
lin = lambda: torch.nn.Linear(4, 4)
PipelineModule = deepspeed.pipe.PipelineModule

if case == "indivisible":      # 3 ranks cannot hold 2 stages of equal replica count
    PipelineModule(layers=[lin(), lin()], num_stages=2)
elif case == "more_stages":    # 2 stages, 1 layer
    PipelineModule(layers=[lin()], num_stages=2)
elif case == "no_layers":      # the second stage gets only a function: nothing to train
    net = PipelineModule(layers=[lin(), torch.relu], num_stages=2, partition_method="uniform",
                         loss_fn=torch.nn.MSELoss())
    deepspeed.initialize(model=net, config=cfg)
elif case == "zero3":
    net = PipelineModule(layers=[lin(), lin()], num_stages=2, loss_fn=torch.nn.MSELoss())
    cfg["zero_optimization"] = {"stage": 3}
    deepspeed.initialize(model=net, config=cfg)
elif case == "ran_out":        # 2 micro-batches per batch, the iterator holds 3
    net = PipelineModule(layers=[lin(), lin()], num_stages=2, loss_fn=torch.nn.MSELoss())
    engine, *_ = deepspeed.initialize(model=net, config=cfg)
    data = iter([(torch.randn(2, 4), torch.randn(2, 4)) for _ in range(3)])
    print("first batch", float(engine.train_batch(data)), flush=True)
    engine.train_batch(data)
elif case == "not_pipeline":
    engine, *_ = deepspeed.initialize(model=lin(), config=cfg)
    engine.train_batch(iter([(torch.randn(2, 4), torch.randn(2, 4))] * 2))
print("no error", flush=True)
'''

CASES = {
    "indivisible": (3, "error: PipelineModule: num_stages=2 does not divide the world size 3"),
    "more_stages": (2, "error: pipeline: 2 stages but only 1 layer; use at most 1 stage"),
    "no_layers": (2, "error: pipeline: stage 1 (layers 1-1: relu) has no trainable parameters for its optimizer"),
    "zero3": (2, "error: zero_optimization.stage: ZeRO stage 3 cannot run under pipeline parallelism"),
    "ran_out": (2, "error: pipeline: the data iterator ran out after 1 of the 2 micro-batches of this batch"),
    "not_pipeline": (1, "error: train_batch: this engine is not a pipeline"),
}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("pipe_errors") / "bad_pipeline.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_pipeline_use_is_one_line_and_exit_2_on_every_rank(script, case):
    nprocs, line = CASES[case]
    runs = run_script([script, case], nprocs=nprocs, timeout=100)
    for rank, run in enumerate(runs):
        shown = json.dumps({"rank": rank, "rc": run.returncode, "stderr": run.stderr[-2000:]})
        assert run.returncode == 2, shown
        errors = [l for l in run.stderr.splitlines() if l.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(line), shown
        assert "Traceback" not in run.stderr and "no error" not in run.stdout, shown
    if case == "ran_out":  # the batch before the short one trained
        assert all("first batch" in r.stdout for r in runs)


@pytest.mark.timeout(200)
def test_seed_gptlite_pipeline_script_trains_on_two_stages(tmp_path):
    runs = run_script([os.path.join(EXAMPLE, "gptlite_pipeline.py"), "--deepspeed_config",
                       os.path.join(EXAMPLE, "gptlite_pipeline.json"), "--steps", "4",
                       "--result_json", str(tmp_path / "result.{rank}.json")], nprocs=2, timeout=180)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    assert not any("RESULT" in r.stdout for r in runs)  # the console gets the human line, not raw JSON
    assert runs[0].stdout.count("trained 4 steps: loss ") == 1
    res = [json.loads((tmp_path / f"result.{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["rank"], r["stage"]) for r in res] == [(0, 0), (1, 1)]
    assert res[0]["losses"] == res[1]["losses"] and len(res[0]["losses"]) == 4  # the same loss on every stage
    assert 4.0 < res[0]["losses"][0] < 6.5  # about ln(256) at the start: a byte-level model
    # rank 0 says once what runs: the start-up line, and which layers each stage runs
    assert runs[0].stdout.count("world 2 = data 1 x pipeline 2 x model 1 | batch 16 = micro 4 x accumulation 4") == 1
    assert runs[0].stdout.count("pipeline: 2 stages x 1 data-parallel, 4 micro-batches of 4; stage 0: layers 0-") == 1
