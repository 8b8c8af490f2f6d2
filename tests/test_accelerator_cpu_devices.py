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

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ds_cpu_device_count.json")
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
