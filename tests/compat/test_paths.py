"""The alias table of DeepSpeed's module paths (compat/paths.py): every entry answers as it says.

An alias is the module it names (the same object, children included); a Names module holds
exactly its names, each the object it names; a refused path is one ImportError line; and
`python -m <alias>` runs the module it names (the old `python -m dslaunch.runtime.consolidate`).
"""
import importlib
import subprocess
import sys

import pytest

from dslaunch.compat import paths

ALIASES = sorted(rel for rel, e in paths.PATHS.items() if isinstance(e, str))
NAMES = sorted(rel for rel, e in paths.PATHS.items() if isinstance(e, paths.Names))
REFUSED = sorted(rel for rel, e in paths.PATHS.items() if isinstance(e, paths.Refused))


@pytest.mark.parametrize("rel", ALIASES)
def test_an_alias_is_the_module_it_names(rel):
    alias = importlib.import_module(f"dslaunch.runtime.{rel}")
    real = importlib.import_module(f"dslaunch.runtime.{paths.PATHS[rel]}")
    assert alias is real
    assert real.__spec__.name == real.__name__ == f"dslaunch.runtime.{paths.PATHS[rel]}"  # it keeps its own spec


@pytest.mark.parametrize("rel", NAMES)
def test_a_names_module_holds_exactly_its_names(rel):
    module = importlib.import_module(f"dslaunch.runtime.{rel}")
    entry = paths.PATHS[rel]
    assert sorted(module.__all__) == sorted(entry.names)
    for name, where in entry.names.items():
        source, _, attr = where.partition(":")
        base = importlib.import_module(f"dslaunch.runtime.{source}")
        # a name may hold a falsy value (an empty default list): only a missing one is a submodule
        missing = object()
        expected = getattr(base, attr or name, missing)
        if expected is missing:
            expected = importlib.import_module(f"{base.__name__}.{attr or name}")
        assert getattr(module, name) is expected, (rel, name)


@pytest.mark.parametrize("rel", REFUSED)
def test_a_refused_path_is_one_import_error_line(rel):
    with pytest.raises(ImportError) as info:
        importlib.import_module(f"dslaunch.runtime.{rel}.anything")
    assert "\n" not in str(info.value) and "is not provided" in str(info.value)


def test_children_of_an_alias_follow_it():
    import dslaunch.runtime.checkpoint.reshard as old  # the shard arithmetic, now zero's
    import dslaunch.runtime.comm.shm as shm

    assert old.__name__ == "dslaunch.runtime.zero.reshard"
    assert shm.__name__ == "dslaunch.runtime.core.comm.shm"
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dslaunch.runtime.no_such_module")


def test_top_level_entries_are_attributes_of_the_runtime():
    import dslaunch.runtime as deepspeed

    assert deepspeed.monitor is importlib.import_module("dslaunch.runtime.train.monitor")
    assert deepspeed.comm.configure is importlib.import_module("dslaunch.runtime.core.comm").configure
    with pytest.raises(AttributeError):
        deepspeed.no_such_name  # noqa: B018
    # a refused top-level path is an absent attribute (hasattr answers False) carrying the reason
    assert not hasattr(deepspeed, "linear")
    with pytest.raises(AttributeError, match="deepspeed.linear .* is not provided"):
        deepspeed.linear  # noqa: B018


def test_python_dash_m_runs_the_module_an_alias_names():
    res = subprocess.run([sys.executable, "-m", "dslaunch.runtime.consolidate", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "CKPT_DIR" in res.stdout


def test_zero_entries_are_attributes_of_the_zero_package():
    """`deepspeed.runtime.zero.utils.ZeRORuntimeException` without importing zero.utils first
    (DeepSpeed's checkpoint tests do): the zero package imports its table entries on first use."""
    code = ("import sys, dslaunch.runtime as ds\n"
            "assert 'dslaunch.runtime.zero.utils' not in sys.modules\n"
            "from dslaunch.runtime.core.errors import ZeRORuntimeException\n"
            "assert ds.zero.utils.ZeRORuntimeException is ZeRORuntimeException\n"
            "from dslaunch.runtime.zero.param_reads import ReadWatch\n"
            "assert ds.zero.parameter_offload.ZeROOrderedDict is ReadWatch  # a table module of names\n"
            "assert not hasattr(ds.zero, 'no_such_module')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
