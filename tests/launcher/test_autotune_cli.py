"""`dslaunch --autotuning tune|run` end to end: 2 CPU ranks, a tiny model, a handful of trials.

One tuning run (module fixture, without re-runs) covers the whole story: the profile trial, the memory
model pruning configurations before any launch (--autotuning_memory_limit), one trial
made to crash and one made to hang (caught by the collective watchdog), both recorded
while tuning goes on, the results folder, and the summary. `run` then reuses those
results (overwrite false) and trains with ds_config_optimal.json and the script's own
arguments. Another tunes a model AutoTP can split, over tp 1 and 2, re-measures the best
interleaved, and its winner and runner-up are re-run once more by the benchmark harness.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dslaunch.launcher.autotune.memory import mib
from dslaunch.launcher.cli import launch
import repo_paths
from dist_harness import DSLAUNCH

JOB = str(repo_paths.WORKERS / "autotune_job.py")
# With this limit the memory model (ZeRO formulas + measured activations of the job's
# model: 33088 fp32 parameters with Adam, 36 KiB of activations per sample, 2 ranks)
# prunes stage 0 from micro-batch 4 up and stage 1 at micro-batch 8.
LIMIT = 650_000
AUTOTUNING = {"enabled": True, "start_profile_step": 1, "end_profile_step": 3, "max_train_batch_size": 16,
              "num_tuning_micro_batch_sizes": 2, "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}}
JOB_ARGS = ["--batch", "1", "--crash", "1:1", "--hang", "1:4"]


def write_config(folder: Path, **autotuning) -> str:
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": [0, 1]},
           "comms_timeout": 3, "steps_per_print": 1000, "autotuning": {**AUTOTUNING, **autotuning}}
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return "cfg.json"


def dslaunch(args, cwd):
    return subprocess.run([*DSLAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    folder = tmp_path_factory.mktemp("autotune")
    cfg = write_config(folder)
    r = dslaunch(["--autotuning", "tune", "--num_gpus", "2", "--autotuning_memory_limit", str(LIMIT),
                  "--autotuning_repeats", "0", JOB, "--deepspeed_config", cfg, *JOB_ARGS], folder)
    assert r.returncode == 0, r.stderr
    return folder, r


def rows(summary: str):
    """experiment name -> its line of summary.txt."""
    lines = summary.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("#  experiment")) + 1
    return {ln.split()[1]: ln for ln in lines[start:] if ln.strip()}


def test_tune_ranks_every_configuration_and_says_why(tuned):
    folder, r = tuned
    results = folder / "autotuning_results"
    table = rows((results / "summary.txt").read_text())
    assert set(table) == {"z0_mbs1_gas1", "z0_mbs2_gas1", "z0_mbs4_gas1", "z0_mbs8_gas1", "z1_mbs1_gas1",
                          "z1_mbs2_gas1", "z1_mbs4_gas1", "z1_mbs8_gas1"}
    ran = {name: json.loads((results / name / "metrics.json").read_text())
           for name in ("z0_mbs1_gas1", "z0_mbs2_gas1")}
    best = max(ran, key=lambda n: ran[n]["throughput"])
    loser = min(ran, key=lambda n: ran[n]["throughput"])
    assert "best: highest throughput" in table[best] and f"less throughput than {best}" in table[loser]
    assert json.loads((results / "ds_config_optimal.json").read_text()) == \
        json.loads((results / best / "ds_config.json").read_text())
    assert table["z1_mbs1_gas1"].endswith("crashed: exit code 1: RuntimeError: injected crash at stage 1 "
                                          "micro-batch 1")
    assert "hung: " in table["z1_mbs4_gas1"] and "collective watchdog" in table["z1_mbs4_gas1"]
    for name in ("z0_mbs4_gas1", "z0_mbs8_gas1", "z1_mbs8_gas1"):
        assert "pruned, not launched: predicted" in table[name] and "> limit 634.8 KiB per rank" in table[name]
        assert not (results / name).exists()
    assert "not tried: not sampled (num_tuning_micro_batch_sizes 2)" in table["z1_mbs2_gas1"]
    assert "[4 done, 0 left]" in r.stderr and f"best so far {best}" in r.stderr


def test_each_trial_is_a_real_launch_that_stops_cleanly_and_is_measured(tuned):
    folder, _ = tuned
    results = folder / "autotuning_results"
    for name in ("z0_mbs1_gas1", "z0_mbs2_gas1"):
        exp = results / name
        assert {"ds_config.json", "cmd.txt", "metrics.json", "stdout.log", "stderr.log"} <= \
            {p.name for p in exp.iterdir()}
        out = (exp / "stdout.log").read_text()
        # the script unwound through its `finally` on both ranks: a clean stop, not exit()
        assert "cleanup ran on rank 0" in out and "cleanup ran on rank 1" in out and "swallowed" not in out
        m = json.loads((exp / "metrics.json").read_text())
        assert m["ranks"] == 2 and m["steps"] == 2 and m["dp"] == 2 and m["throughput"] > 0
        cmd = (exp / "cmd.txt").read_text()
        assert "dslaunch --num_gpus 2" in cmd and f"--deepspeed_config {exp}/ds_config.json" in cmd
        assert f"--batch {m['micro_batch']}" in cmd
        # the memory model against what the trial measured (live tensors + saved activations)
        line = rows((results / "summary.txt").read_text())[name]
        predicted, measured = [float(line.split()[i]) for i in (3, 5)]
        assert 0.8 < measured / predicted < 1.25, line
    assert (folder / "autotuning_exps" / "z1_mbs1_gas1.json").is_file()


def test_run_trains_with_the_best_configuration_and_the_scripts_own_arguments(tuned, tmp_path):
    folder, _ = tuned
    write_config(folder, overwrite=False)  # reuse every outcome: no trial runs again
    r = dslaunch(["--autotuning", "run", "--num_gpus", "2", "--autotuning_memory_limit", str(LIMIT),
                  "--autotuning_repeats", "0", JOB,
                  "--deepspeed_config", "cfg.json", *JOB_ARGS, "--steps", "7", "--out", str(tmp_path / "trained.json")],
                 folder)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("reusing its earlier outcome") == 5
    optimal = json.loads((folder / "autotuning_results" / "ds_config_optimal.json").read_text())
    trained = json.loads((tmp_path / "trained.json").read_text())
    assert trained == {"stage": optimal["zero_optimization"]["stage"],
                       "micro_batch": optimal["train_micro_batch_size_per_gpu"], "gas": 1, "steps": 7}


@pytest.mark.parametrize("config, extra, message", [
    ({}, ["--no_python"], "--autotuning needs a Python script"),
    ({"autotuning": {"enabled": False}}, [], "cfg.json: autotuning.enabled is false; set it true to tune"),
    ({"autotuning": {"metric": "flops"}}, [], "autotuning.metric: 'flops'"),
    ({"zero_optimization": {"stage": 5}}, [], "zero_optimization.stage: 5"),
    ({}, ["--autotuning_repeats", "1"], "--autotuning_repeats 1: give 0 (no re-runs) or 2 or more"),
    # a section that is no mapping was ignored (the defaults tuned instead); a folder no file can be made in
    # gave a traceback after the profile trial had been set up
    ({"autotuning": [{"enabled": True}]}, [], "cfg.json: autotuning: must be a JSON object of keys and values, "
                                              "not a list"),
    ({"autotuning": "on"}, [], "cfg.json: autotuning: must be a JSON object of keys and values, not a str"),
    ({"autotuning": {"results_dir": "/proc/self"}}, [], "autotuning.results_dir /proc/self: cannot write there"),
    ({"autotuning": {"exps_dir": "/proc/self/x"}}, [], "autotuning.exps_dir /proc/self/x: cannot write there"),
    ({"autotuning": {"results_dir": "t.py"}}, [], "autotuning.results_dir t.py: cannot write there"),
    (None, [], "cfg.json: config file is a FIFO, not a regular file"),
    ({"autotuning": {"results_dir": "/tmp"}}, [], "autotuning.results_dir /tmp: every user (mode 1777) can write "
                                                  "there"),
])
def test_bad_requests_are_one_line(tmp_path, monkeypatch, config, extra, message):
    monkeypatch.chdir(tmp_path)  # nothing may start, but if it did, its results stay here
    if config is None:
        os.mkfifo(tmp_path / "cfg.json")  # nobody writes to it: reading it would wait forever
    else:
        (tmp_path / "cfg.json").write_text(json.dumps(config))
    (tmp_path / "t.py").write_text("")
    result = CliRunner().invoke(launch, ["--autotuning", "tune", *extra, str(tmp_path / "t.py"), "--deepspeed_config",
                                         str(tmp_path / "cfg.json")], prog_name="dslaunch")
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1, \
        result.stderr
    assert not (tmp_path / "autotuning_results").exists()  # refused before any trial


def test_a_script_without_a_config_argument_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(launch, ["--autotuning", "tune", "t.py", "--lr", "1"], prog_name="dslaunch")
    assert result.exit_code == 2 and "the script's arguments name no config" in result.stderr


def test_a_trial_over_the_budget_is_stopped(tmp_path):
    cfg = write_config(tmp_path)
    r = dslaunch(["--autotuning", "tune", "--num_gpus", "2", "--autotuning_budget", "1", "--kill_grace", "1", JOB,
                  "--deepspeed_config", cfg, *JOB_ARGS], tmp_path)
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith(
        "dslaunch: error: the profile trial timed out: stopped after "), r.stderr
    assert "the --autotuning_budget ran out" in r.stderr
    outcome = json.loads((tmp_path / "autotuning_results" / "profile_model_info" / "outcome.json").read_text())
    assert outcome["status"] == "timed out"


CKPT_JOB = str(repo_paths.WORKERS / "autotune_ckpt_job.py")


def test_activation_checkpointing_is_tuned_through_the_scripts_switch(tmp_path):
    """The job (70464 fp32 parameters with Adam: 1101 KiB of model states; 4 blocks of 20 KiB
    of activations per sample) switches checkpointing with --ckpt. One profile trial with it
    on measures both ways: 40 KiB per sample on, 84 KiB off. Under the limit, micro-batch 2
    fits only with checkpointing on: the memory model prunes it off, and keeps it on."""
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "steps_per_print": 1000, "tensor_parallel": {"autotp_size": 1},  # AutoTP could split it: not here
           "autotuning": {"start_profile_step": 1, "end_profile_step": 3, "max_train_batch_size": 4,
                          "num_tuning_micro_batch_sizes": 1,
                          "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch",
                                           "activation_checkpointing": "--ckpt"}}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = dslaunch(["--autotuning", "tune", "--num_gpus", "2", "--autotuning_memory_limit", "1250000",
                  "--autotuning_repeats", "0", CKPT_JOB,
                  "--deepspeed_config", "cfg.json", "--batch", "1", "--ckpt", "false"], tmp_path)
    assert r.returncode == 0, r.stderr
    results = tmp_path / "autotuning_results"
    summary = (results / "summary.txt").read_text()
    assert "activation checkpointing (measured in profile_model_info): 40.0 KiB per sample with it on, " \
           "84.0 KiB with it off" in summary
    table = rows(summary)
    assert set(table) == {"z0_mbs1_gas1_nockpt", "z0_mbs1_gas1_ckpt", "z0_mbs2_gas1_nockpt", "z0_mbs2_gas1_ckpt"}
    assert "pruned, not launched: predicted 1.2 MiB > limit 1.2 MiB per rank" in table["z0_mbs2_gas1_nockpt"]
    for name, flag in (("z0_mbs1_gas1_nockpt", "--ckpt false"), ("z0_mbs2_gas1_ckpt", "--ckpt true")):
        assert flag in (results / name / "cmd.txt").read_text()
        m = json.loads((results / name / "metrics.json").read_text())
        # what the trial measured against what the model predicted, for each way
        assert m["activation_bytes_per_sample"] == (40 if flag.endswith("true") else 84) * 1024
        predicted = 70464 * 16 + m["activation_bytes_per_sample"] * m["micro_batch"]
        assert 0.9 < m["measured_bytes"] / predicted < 1.1, (name, m["measured_bytes"], predicted)
    best = next(ln for ln in summary.splitlines() if ln.startswith("best: ")).split()[1]
    assert best in ("z0_mbs1_gas1_nockpt", "z0_mbs2_gas1_ckpt"), summary
    assert ("--ckpt true" if best.endswith("_ckpt") else "--ckpt false") in (results / "cmd_optimal.txt").read_text()


TP_JOB = str(repo_paths.WORKERS / "autotune_tp_job.py")
BENCH = str(repo_paths.ROOT / "scripts" / "bench_autotune.py")


def test_the_winner_measurably_beats_the_runner_up_when_re_run(tmp_path):
    """Micro-batch 16 against 1 on the tiny job (2 ranks): a real gap of several times, never a
    near tie. Both are re-measured interleaved by the tuner; the benchmark harness then runs
    the winner and the runner-up it named again, alternating, and their order must hold (a
    wrong ranking fails it; no time is asserted). The job's model has no tensor-parallel plan:
    the summary says why degree 2 is not tuned."""
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "steps_per_print": 1000, "autotuning": {**AUTOTUNING, "max_train_batch_size": 32, "end_profile_step": 4}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = dslaunch(["--autotuning", "tune", "--num_gpus", "2", "--autotuning_repeats", "2", JOB,
                  "--deepspeed_config", "cfg.json", "--batch", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    results = tmp_path / "autotuning_results"
    summary = (results / "summary.txt").read_text()
    assert "tensor parallel (AutoTP, asked in profile_model_info): degree 1 only: degree 2: found no repeated " \
           "blocks" in summary
    assert (results / "reruns.json").is_file(), r.stderr[-3000:]  # no re-run failed
    verdict = json.loads((results / "reruns.json").read_text())
    assert set(verdict["runs"]) == {"z0_mbs1_gas1", "z0_mbs16_gas1"}
    assert all(len(v) == 2 for v in verdict["runs"].values())
    for name in verdict["runs"]:
        assert (results / name / "rerun2" / "metrics.json").is_file()
    winner, runner_up = verdict["winner"], verdict["runner_up"]
    assert runner_up and max(verdict["runs"][runner_up]) < min(verdict["runs"][winner])
    assert f"best: {winner} (" in summary and f"runner-up: {runner_up} (" in summary
    assert json.loads((results / "ds_config_optimal.json").read_text()) == \
        json.loads((results / winner / "ds_config.json").read_text())
    bench = subprocess.run([sys.executable, BENCH, "--repeat", "2"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert bench.returncode == 0 and "order holds: yes" in bench.stdout, bench.stdout + bench.stderr
    assert f"winner    {winner}:" in bench.stdout and f"runner-up {runner_up}:" in bench.stdout


def test_a_tensor_parallel_degree_autotp_allows_is_tuned(tmp_path):
    """The job's 8 blocks are split by AutoTP as its config's partition_config says; the
    profile trial (tp 1) finds degree 2 allowed on 2 ranks. With the degree listed, the one
    trial runs at tp 2 over 1 data-parallel rank, keeps the global batch of 8, and is ranked;
    the memory model counts the shard."""
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "train_batch_size": 8, "steps_per_print": 1000,
           "tensor_parallel": {"autotp_size": [2], "partition_config": {"layer_specs": [
               {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
               {"patterns": [r".*\.down\.weight$"], "partition_type": "row"}]}},
           "autotuning": {"start_profile_step": 1, "end_profile_step": 2, "num_tuning_micro_batch_sizes": 1,
                          "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    r = dslaunch(["--autotuning", "tune", "--num_gpus", "2", "--autotuning_memory_limit", "1GiB",
                  TP_JOB, "--deepspeed_config", "cfg.json", "--batch", "1"], tmp_path)
    assert r.returncode == 0, r.stderr
    results = tmp_path / "autotuning_results"
    summary = (results / "summary.txt").read_text()
    # 8 x (up 32x128 + its bias 128 + down 128x32): the down biases (and nothing else) stay whole
    assert "tensor parallel: degree 2 (fixed by tensor_parallel.autotp_size); degree 2 splits 66560 of 66816 " \
           "parameters" in summary
    table = rows(summary)
    assert table["z0_mbs8_gas1_tp2"].startswith("1  ") and "best:" in table["z0_mbs8_gas1_tp2"]
    m = json.loads((results / "z0_mbs8_gas1_tp2" / "metrics.json").read_text())
    assert (m["tp"], m["dp"], m["train_batch_size"], m["micro_batch"], m["ranks"]) == (2, 1, 8, 8, 2)
    assert json.loads((results / "ds_config_optimal.json").read_text())["tensor_parallel"]["autotp_size"] == 2
    # model states of (66816 - 66560 / 2) parameters at 16 bytes (fp32 Adam), plus 8 samples of the
    # activations measured at tp 1 (an upper bound: the measured bytes stay below)
    profile = json.loads((results / "profile_model_info" / "metrics.json").read_text())
    predicted = int((66816 - 66560 / 2) * 16 + 8 * profile["activation_bytes_per_sample"])
    assert table["z0_mbs8_gas1_tp2"].split()[3:5] == mib(predicted).split()
    assert m["measured_bytes"] <= predicted < 66816 * 16 + 8 * profile["activation_bytes_per_sample"]
