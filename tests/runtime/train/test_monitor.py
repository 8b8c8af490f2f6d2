"""Monitors: one engine run writes TensorBoard event files and CSV files under DeepSpeed's
event names (train_loss, lr, loss_scale, the wall_clock_breakdown timers) plus the
user's own events from engine.monitor.write_events; wandb and comet get the same events
through their client APIs; a monitor whose package is missing is one line."""
import csv
import os
import sys
import types

from dist_harness import run_function

from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.monitor import LR, TRAIN_LOSS, StepRecord, build_monitor

NAMES = ["Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale",
         "Train/Samples/elapsed_time_ms_forward", "Train/Samples/elapsed_time_ms_backward",
         "Train/Samples/elapsed_time_ms_backward_inner", "Train/Samples/elapsed_time_ms_backward_allreduce",
         "Train/Samples/elapsed_time_ms_step"]


def _train_with_monitors(out):
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 2,
           "wall_clock_breakdown": True, "fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8},
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb"},
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv"}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.set_train_steps(3)
    for i in range(6):
        x = torch.randn(4, 8)  # float32: fp16.auto_cast casts it
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.monitor.write_events([("Eval/accuracy", 0.75, engine.global_samples)])
    engine.destroy()
    return engine.global_samples


def test_engine_writes_deepspeed_events_to_tensorboard_and_csv(tmp_path, capfd):
    out = str(tmp_path)
    samples = run_function(_train_with_monitors, nprocs=1, kwargs={"out": out}, timeout=180)[0]
    assert samples == 24
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert set(NAMES) | {"Eval/accuracy"} <= set(tags), tags
    assert [e.step for e in acc.Scalars(TRAIN_LOSS)] == [8, 16, 24]  # x is the global sample count
    assert acc.Scalars("Eval/accuracy")[0].value == 0.75
    assert all(e.value > 0 for e in acc.Scalars("Train/Samples/elapsed_time_ms_forward"))

    files = sorted(os.listdir(os.path.join(out, "csv")))
    assert "Train_Samples_train_loss.csv" in files and "Eval_accuracy.csv" in files
    with open(os.path.join(out, "csv", "Train_Samples_loss_scale.csv")) as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["step", "loss_scale"] and [r[0] for r in rows[1:]] == ["8", "16", "24"]
    assert float(rows[1][1]) == 256.0
    with open(os.path.join(out, "csv", "Train_Samples_train_loss.csv")) as fh:
        losses = [float(r[1]) for r in list(csv.reader(fh))[1:]]
    assert [round(v, 6) for v in losses] == [round(e.value, 6) for e in acc.Scalars(TRAIN_LOSS)]


class _Recorder(types.ModuleType):
    def __init__(self, name):
        super().__init__(name)
        self.calls = []


def _fake_wandb():
    mod = _Recorder("wandb")
    mod.init = lambda **kw: mod.calls.append(("init", kw))
    mod.log = lambda data, step=None: mod.calls.append(("log", data, step))
    mod.finish = lambda: mod.calls.append(("finish",))
    return mod


def _fake_comet():
    mod = _Recorder("comet_ml")

    class Experiment:
        def set_name(self, name):
            mod.calls.append(("name", name))

        def log_metric(self, name, value, step=None):
            mod.calls.append(("metric", name, value, step))

        def end(self):
            mod.calls.append(("end",))

    def start(**kw):
        mod.calls.append(("start", kw))
        return Experiment()

    mod.start = start
    return mod


def test_wandb_and_comet_get_the_events(monkeypatch):
    wandb, comet = _fake_wandb(), _fake_comet()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    cfg = DeepSpeedConfig.load({"wandb": {"enabled": True, "project": "p", "team": "t", "group": "g"},
                                "comet": {"enabled": True, "project": "cp", "samples_log_interval": 16,
                                          "experiment_name": "run1", "online": False}})
    monitor = build_monitor(cfg, rank=0)
    for step in (1, 2, 3):
        monitor.write_step(StepRecord(step=step, samples=8 * step, values={TRAIN_LOSS: 1.0 / step, LR: 0.1}))
    monitor.close()
    assert wandb.calls[0] == ("init", {"project": "p", "group": "g", "entity": "t"})
    assert ("log", {TRAIN_LOSS: 0.5}, 16) in wandb.calls and wandb.calls[-1] == ("finish",)
    assert comet.calls[0][0] == "start" and comet.calls[0][1]["project"] == "cp" and comet.calls[0][1]["online"] is False
    assert ("name", "run1") in comet.calls
    sent = [(c[1], c[3]) for c in comet.calls if c[0] == "metric"]
    assert sent == [(TRAIN_LOSS, 8), (LR, 8), (TRAIN_LOSS, 24), (LR, 24)]  # every 16 samples per event
    assert build_monitor(cfg, rank=1).sinks == []  # only rank 0 writes


def test_enabled_monitor_without_its_package_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    cfg = DeepSpeedConfig.load({"wandb": {"enabled": True}, "csv_monitor": {"enabled": False}})
    monitor = build_monitor(cfg, rank=0)
    assert monitor.sinks == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: wandb.enabled: the wandb package is not installed; no events "
                                               "go to wandb")


def test_deepspeeds_monitor_classes_write_through_the_same_sinks(tmp_path, monkeypatch):
    """deepspeed.monitor.monitor's classes, built from DeepSpeedConfig.monitor_config as a
    DeepSpeed script builds them: MonitorMaster opens every enabled section and its events
    land as the engine's own (TensorBoard scalars, CSV rows, wandb.log, comet metrics); a
    disabled section opens nothing."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dslaunch.runtime.monitor.config import DeepSpeedMonitorConfig
    from dslaunch.runtime.monitor.monitor import MonitorMaster, TensorBoardMonitor, csvMonitor

    wandb, comet = _fake_wandb(), _fake_comet()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    cfg = DeepSpeedConfig.load({
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"},
        "wandb": {"enabled": True, "project": "p"}, "comet": {"enabled": True, "samples_log_interval": 16}})
    master = MonitorMaster(cfg.monitor_config)
    assert master.enabled and master.comet_monitor.samples_log_interval == 16
    events = [(TRAIN_LOSS, 0.5, 8), (LR, 0.25, 8)]
    master.write_events(events)
    master.tb_monitor.flush()
    acc = EventAccumulator(str(tmp_path / "tb" / "job"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars(TRAIN_LOSS)] == [(8, 0.5)]
    with open(tmp_path / "csv" / "job" / "Train_Samples_train_loss.csv") as fh:
        assert list(csv.reader(fh)) == [["step", "train_loss"], ["8", "0.5"]]
    assert ("log", {TRAIN_LOSS: 0.5}, 8) in wandb.calls
    assert [c[1:] for c in comet.calls if c[0] == "metric"] == [(TRAIN_LOSS, 0.5, 8), (LR, 0.25, 8)]
    assert master.comet_monitor.experiment is not None
    defaults = DeepSpeedMonitorConfig()
    assert not defaults.enabled
    off = TensorBoardMonitor(defaults.tensorboard)
    off.write_events(events)
    assert off.sink is None and not off.enabled and off.job_name == "DeepSpeedJobName"
    assert csvMonitor(defaults.csv_monitor).sink is None
