"""scripts/gpu_check.sh's plumbing, on a machine without a GPU: the dry run, a fake nvidia-smi
with no CUDA torch, and no nvidia-smi at all each give a full report in which every step says why
it did not run, and the exit code is 0. The GPU steps themselves run only on a GPU machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from script_modules import load_script
import repo_paths

ROOT = repo_paths.ROOT
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


_load = load_script


def run_check(tmp_path, *args, path_prefix=None, strip_nvidia=False):
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")  # torch must see no GPU here
    path = env.get("PATH", "")
    if strip_nvidia:  # a PATH with no nvidia-smi on it: only the interpreter's folder and the basics
        path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    if path_prefix:
        path = f"{path_prefix}{os.pathsep}{path}"
    env["PATH"] = path
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), "--out", str(out), "--wheels", str(tmp_path / "no-wheels"), *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    return proc, out


def fake_nvidia_smi(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\nif [ "$1" = "-L" ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"; '
                   'else echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04"; fi\n')
    smi.chmod(0o755)
    return bin_dir


def steps_of(out: Path):
    report = json.loads((out / "gpu_report.json").read_text())
    return {s["step"]: s for s in report["steps"]}, report


def test_dry_run_plans_every_step_and_runs_nothing(tmp_path):
    proc, out = run_check(tmp_path, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    steps, report = steps_of(out)
    assert list(steps) == ["a", "b", "c", "d", "e", "f"]
    assert all(s["status"] == "dry run" for s in steps.values())
    assert report["dry_run"] is True
    md = (out / "gpu_report.md").read_text()
    assert "Dry run: nothing was executed" in md
    for key in "abcdef":
        assert f"step {key}:" in proc.stdout


def test_fake_nvidia_smi_without_cuda_skips_every_step_with_the_reason(tmp_path):
    proc, out = run_check(tmp_path, path_prefix=fake_nvidia_smi(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    steps, report = steps_of(out)
    assert report["gpu"] is False
    for key, step in steps.items():
        assert step["status"] == "skipped: no GPU (torch sees no CUDA device)", (key, step["status"])
    # step a still records what the machine said
    assert "H100" in steps["a"]["figures"]["nvidia_smi"]
    assert steps["a"]["figures"]["torch"] == torch.__version__
    md = (out / "gpu_report.md").read_text()
    assert md.count("skipped: no GPU") >= 6
    assert (out / "gpu_check.log").exists()


def test_no_nvidia_smi_at_all_is_a_reason_too(tmp_path):
    proc, out = run_check(tmp_path, strip_nvidia=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps, _ = steps_of(out)
    assert {s["status"] for s in steps.values()} == {"skipped: no GPU (no nvidia-smi on PATH)"}


def test_an_unknown_step_is_a_usage_error(tmp_path):
    proc, _ = run_check(tmp_path, "--only", "a,z")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["gpu_check: --only: unknown step 'z'; steps are a, b, c, d, e, f"]


@pytest.mark.parametrize("n_embd,n_layer,n_head,block", [(64, 2, 4, 32), (96, 3, 6, 16)])
def test_the_parameter_formula_counts_the_benchmark_model(n_embd, n_layer, n_head, block):
    gc = _load("gpu_check")
    bench = _load("bench_gptlite")
    model = bench.GPTlite(gc.VOCAB, block, n_embd, n_head, n_layer)
    assert gc.gptlite_params(n_embd, n_layer, block) == sum(p.numel() for p in model.parameters())


def test_the_ladder_and_the_medium_model_have_the_sizes_they_are_named_for():
    gc = _load("gpu_check")
    name, d, layers, _ = gc.MEDIUM
    assert 0.3e9 < gc.gptlite_params(d, layers, 512) < 0.4e9
    for name, d, layers, heads in gc.LADDER:
        billions = float(name.rstrip("B"))
        assert abs(gc.gptlite_params(d, layers, 512) / 1e9 - billions) / billions < 0.1, name
        assert d % heads == 0
