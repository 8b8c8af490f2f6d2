"""deepspeed.accelerator.cpu_accelerator.CPU_Accelerator against DeepSpeed 0.19.8's class
(tests/data/ds_cpu_accelerator.json, made by scripts/make_ds_cpu_accelerator_fixture.py with
LOCAL_SIZE=2): the same answers to the device calls, and set_accelerator() makes it the one
get_accelerator() returns. DeepSpeed's AutoEP tests start their gloo workers this way."""
from __future__ import annotations

import json
import os

import pytest
import repo_paths
import torch

with open(os.path.join(repo_paths.DATA, "ds_cpu_accelerator.json")) as _fh:
    DS = json.load(_fh)

# DeepSpeed's CPU accelerator answers device(i) with None; ours with torch.device("cpu"), which
# tensor.to() and the tensor constructors take as DeepSpeed's None would not be (better, not worse)
OURS_DIFFER = {"device(0)": "cpu"}


@pytest.fixture
def cpu_accelerator_class(monkeypatch):
    import dslaunch.runtime  # noqa: F401  (puts the alias table's finder on sys.meta_path)
    from dslaunch.runtime.accelerator import real_accelerator

    monkeypatch.setenv("LOCAL_SIZE", DS["local_size"])
    # set_accelerator replaces the process's accelerator: give back the one in place after
    monkeypatch.setattr(real_accelerator, "_ACCEL", real_accelerator._ACCEL)
    from dslaunch.runtime.accelerator.cpu_accelerator import CPU_Accelerator
    return CPU_Accelerator


@pytest.mark.parametrize("call", sorted(DS["calls"]))
def test_cpu_accelerator_answers_as_deepspeed(call, cpu_accelerator_class):
    cpu = cpu_accelerator_class()
    if call == "on_accelerator(cpu tensor)":
        got = cpu.on_accelerator(torch.zeros(1))
    else:
        name, _, args = call.partition("(")
        args = tuple(int(a) for a in args.rstrip(")").split(",") if a)
        got = getattr(cpu, name)(*args)
    assert str(got) == OURS_DIFFER.get(call, DS["calls"][call])


def test_set_accelerator_makes_it_current(cpu_accelerator_class):
    from dslaunch.runtime.accelerator import get_accelerator, set_accelerator

    assert DS["set_accelerator_is_get_accelerator"]
    cpu = cpu_accelerator_class()
    set_accelerator(cpu)
    assert get_accelerator() is cpu
    assert get_accelerator().device_name() == "cpu"


def test_backend_is_gloo_as_recorded_without_oneccl(cpu_accelerator_class):
    # the fixture was recorded without Intel's oneCCL bindings, where DeepSpeed says gloo too;
    # with them DeepSpeed says "ccl", a backend dslaunch's comm does not speak
    assert DS["oneccl_bindings"] is False
    assert cpu_accelerator_class().communication_backend_name() == "gloo"


def test_it_is_the_accelerator_class(cpu_accelerator_class):
    from dslaunch.runtime.accelerator import DeepSpeedAccelerator

    assert issubclass(cpu_accelerator_class, DeepSpeedAccelerator)
