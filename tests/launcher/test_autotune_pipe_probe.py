"""The autotuning trial probe inside a PipelineModule's train_batch: a pipeline trial counts
its activations and the bytes held after backward as a plain engine's trial does, and scales
the activations by the micro-batches a stage holds at once."""
import json
import os

from dist_harness import run_function


def _trial(root, pipeline):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.autotuning import TrialComplete
    from dslaunch.runtime.pipe import PipelineModule

    os.environ["DSLAUNCH_TRIAL_DIR"] = root
    os.environ["DSLAUNCH_TRIAL_STEPS"] = "1:2"
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)]
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(16)]
    if pipeline:
        net = PipelineModule(layers, num_stages=1, loss_fn=torch.nn.MSELoss())
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
        it = iter(data)
        try:
            for _ in range(8):
                engine.train_batch(it)
        except TrialComplete:
            pass
    else:
        net = torch.nn.Sequential(*layers)
        engine, _, _, _ = deepspeed.initialize(model=net, config=cfg, model_parameters=net.parameters())
        try:
            for x, y in data:
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
        except TrialComplete:
            pass
    with open(os.path.join(root, "metrics_rank0.json")) as fh:
        return json.load(fh)


def test_pipeline_trial_measures_activations_like_the_plain_engine(tmp_path):
    (pipe,) = run_function(_trial, nprocs=1, kwargs={"root": str(tmp_path / "pipe"), "pipeline": True})
    (plain,) = run_function(_trial, nprocs=1, kwargs={"root": str(tmp_path / "plain"), "pipeline": False})
    assert pipe["forward_saved_bytes_per_sample"] > 0
    for key in ("forward_saved_bytes_per_sample", "activation_bytes_per_sample", "micro_batches_in_flight"):
        assert pipe[key] == plain[key], key
    assert pipe["steps"] == plain["steps"] == 1


def test_a_stage_scales_its_activations_by_the_micro_batches_it_holds():
    from dslaunch.runtime.autotuning import TrialProbe
    from dslaunch.runtime.pipe.schedule import TrainSchedule

    # 1F1B over 4 stages and 3 micro-batches: stage 0 holds 3 forwards before its first backward
    assert [TrainSchedule(3, 4, s).activations_in_flight() for s in range(4)] == [3, 3, 2, 1]
    assert [TrainSchedule(8, 2, s).activations_in_flight() for s in range(2)] == [2, 1]

    probe = TrialProbe.__new__(TrialProbe)
    probe.forward_saved, probe.kept_bytes, probe.segments, probe.in_flight = 100, 20, [50, 70], 3
    assert probe.peak_saved == 120 * 3 + 70
