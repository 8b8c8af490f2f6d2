"""The CPU accelerator's device count against DeepSpeed's CPU accelerator
(tests/data/ds_cpu_device_count.json, made by scripts/make_ds_cpu_device_count_fixture.py):
LOCAL_SIZE first, then the NUMA nodes numactl lists, through get_accelerator().device_count()
with a fake numactl first on PATH, as the fixture was recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import repo_paths

DATA = os.path.join(repo_paths.DATA, "ds_cpu_device_count.json")
with open(DATA) as _fh:
    CASES = json.load(_fh)["cases"]

PROBE = ("from dslaunch.runtime.accelerator import get_accelerator; "
         "print(get_accelerator().device_count())")


def _count(tmp_path, local_size, numactl_out) -> int:
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PATH"] = os.pathsep.join([str(tmp_path), os.path.dirname(sys.executable)])
    if local_size is not None:
        env["LOCAL_SIZE"] = local_size
    if numactl_out is not None:
        (tmp_path / "output.txt").write_text(numactl_out)
        fake = tmp_path / "numactl"
        fake.write_text(f"#!/bin/sh\n/bin/cat {tmp_path / 'output.txt'}\n")
        fake.chmod(0o755)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_device_count_as_deepspeed(name, tmp_path):
    case = CASES[name]
    got = _count(tmp_path, case["local_size"], case["numactl"])
    if isinstance(case["device_count"], dict):
        # DeepSpeed raises (UnboundLocalError) on numactl output without an `available:` line;
        # dslaunch reads that as no NUMA information, as it reads a missing numactl: 1 device
        assert "raises" in case["device_count"]
        assert got == 1
    else:
        assert got == case["device_count"]


def test_bad_local_size_names_the_variable(monkeypatch):
    from dslaunch.runtime.accelerator.cpu_devices import cpu_device_count

    monkeypatch.setenv("LOCAL_SIZE", "four")
    with pytest.raises(ValueError, match="LOCAL_SIZE='four'"):
        cpu_device_count()


def test_parse_numactl_hardware():
    from dslaunch.runtime.accelerator.cpu_devices import numa_device_count, parse_numactl_hardware

    nodes = parse_numactl_hardware("available: 2 nodes (0-1)\nnode 0 cpus: 0 1\nnode 1 cpus:\n")
    assert nodes == [[0, 1], []]
    assert numa_device_count(nodes) == 1
    assert parse_numactl_hardware("") == [] and numa_device_count([]) == 1


def test_dtypes_as_deepspeed_reports_them(monkeypatch):
    """DeepSpeed's CPU accelerator lists fp16 where oneDNN has native fp16 kernels; the fixture
    holds its answers on the recording machine, with oneDNN's answer there. Ours follow the same
    rule for either answer of oneDNN (None where DeepSpeed says no is False here)."""
    import torch

    from dslaunch.runtime.accelerator import cpu_devices
    from dslaunch.runtime.accelerator.real_accelerator import DeepSpeedAccelerator

    with open(DATA) as fh:
        ds = json.load(fh)["dtypes"]
    cpu = DeepSpeedAccelerator(cuda=False)
    for fp16 in (False, True):
        monkeypatch.setattr(cpu_devices.torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: fp16)
        ours = [str(d) for d in cpu.supported_dtypes()]
        assert cpu.is_fp16_supported() is fp16 and cpu.is_bf16_supported() is True
        if fp16 == ds["mkldnn_fp16"]:
            assert ours == ds["supported_dtypes"] and bool(ds["is_fp16_supported"]) is fp16
        assert ours == ["torch.float32", "torch.bfloat16"] + (["torch.float16"] if fp16 else [])
    assert torch.float16 not in DeepSpeedAccelerator(cuda=False).supported_dtypes() or \
        torch.ops.mkldnn._is_mkldnn_fp16_supported()
