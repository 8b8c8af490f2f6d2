"""deepspeed.utils.nvtx (runtime/core/accelerator/nvtx.py) against DeepSpeed 0.19.8: for each case
of scripts/nvtx_cases.py, instrument_w_nvtx makes the range calls DeepSpeed recorded in
tests/data/ds_nvtx.json (scripts/make_ds_nvtx_fixtures.py); and our accelerator takes them."""
import importlib
import json

import pytest

import dslaunch.runtime  # noqa: F401  installs the alias table
from repo_paths import DATA
from script_modules import load_script

# deepspeed.utils.nvtx is dslaunch.runtime.utils.nvtx (the `deepspeed` package maps one to the other)
nvtx = importlib.import_module("dslaunch.runtime.utils.nvtx")
cases = load_script("nvtx_cases")
DS = json.loads((DATA / "ds_nvtx.json").read_text())


def test_fixture_is_deepspeed_0198():
    assert DS["deepspeed"] == "0.19.8"


@pytest.mark.parametrize("case", sorted(DS["cases"]))
def test_ranges_match_deepspeed(case):
    assert cases.run_all(nvtx)[case] == DS["cases"][case]


def test_path_is_our_module():
    from dslaunch.runtime.core.accelerator import nvtx as ours
    assert nvtx is ours


def test_a_raising_function_still_closes_its_range():
    """Better than DeepSpeed on purpose: its wrapper skips range_pop when the function raises,
    leaving the profiler's ranges unbalanced."""
    calls = []
    saved = nvtx.get_accelerator
    nvtx.get_accelerator = lambda: cases.PlainAccelerator(calls)
    try:
        def boom():
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            nvtx.instrument_w_nvtx(boom)()
    finally:
        nvtx.get_accelerator = saved
    assert calls == [["push", "test_a_raising_function_still_closes_its_range.<locals>.boom"], ["pop"]]


def test_our_accelerator_takes_the_ranges():
    """On the CPU (this machine) the ranges are no-ops and the function runs; the wrapper keeps
    its name."""
    wrapped = nvtx.instrument_w_nvtx(cases.sample)
    assert wrapped(1, y=2) == 3
    assert wrapped.__name__ == "sample"
    accel = nvtx.get_accelerator()
    assert accel.range_push("x") is None and accel.range_pop() is None
