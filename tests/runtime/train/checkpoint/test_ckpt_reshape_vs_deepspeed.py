"""deepspeed.checkpoint's folder readers (train/checkpoint/ds_checkpoint.py, reshape3d.py)
against DeepSpeed 0.19.8's recorded answers (scripts/make_ds_ckpt_reshape_fixtures.py):
scripts/ckpt_reshape_cases.py's cases replayed through DeepSpeed's paths under
dslaunch.runtime. Values must be equal; where DeepSpeed refuses, dslaunch refuses too, naming
the same model-state files (the folders are temporary, so the paths differ).

Where dslaunch differs on purpose (ds_checkpoint.py says why): files are read weights_only,
a ZeRO-3 folder's model-state files are not counted as ZeRO files, and merging keeps keys only
the first state has. None of these cases reaches those differences.
"""
from __future__ import annotations

import json
import re
import types

import pytest

import repo_paths
from script_modules import load_script

EXPECTED = json.loads((repo_paths.DATA / "ds_ckpt_reshape.json").read_text())["cases"]


@pytest.fixture(scope="module")
def ours():
    import dslaunch.runtime  # noqa: F401  (installs DeepSpeed's paths)
    from dslaunch.runtime.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc
    from dslaunch.runtime.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
    from dslaunch.runtime.engine import _checkpoint_parallel_metadata

    ds = types.SimpleNamespace(model_3d_desc=model_3d_desc, get_model_3d_descriptor=get_model_3d_descriptor,
                               ZeROCheckpoint=ZeROCheckpoint, DeepSpeedCheckpoint=DeepSpeedCheckpoint,
                               aggregate_autoep=_aggregate_autoep_zero12_metadata,
                               parallel_metadata=_checkpoint_parallel_metadata)
    # through JSON, as the fixture was written: tuples become lists, keys strings
    return json.loads(json.dumps(load_script("ckpt_reshape_cases").run(ds), sort_keys=True))


def _files_named(message: str):
    return sorted(set(re.findall(r"mp_rank_\d+_model_states\.pt", message)))


def _same(got, want, where):
    """Equal, item by item; a recorded refusal ({"error": ...}) matched by a refusal."""
    if isinstance(want, dict) and set(want) == {"error"}:
        assert isinstance(got, dict) and set(got) == {"error"}, f"{where}: DeepSpeed refuses ({want['error']}), " \
                                                                 f"dslaunch answers {got}"
        assert _files_named(got["error"]) == _files_named(want["error"]), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for key in want:
            _same(got[key], want[key], f"{where} {key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.parametrize("part", sorted(EXPECTED))
def test_checkpoint_readers_equal_deepspeed(ours, part):
    _same(ours[part], EXPECTED[part], part)


def test_refusals_are_one_line_checkpoint_errors(tmp_path):
    import dslaunch.runtime  # noqa: F401
    from dslaunch.runtime.checkpoint import CheckpointError, DeepSpeedCheckpoint, model_3d_desc

    with pytest.raises(CheckpointError, match="Expansion reshape not supported - PP: 1 ---> 2") as err:
        model_3d_desc(1, 2, 2).reshape(model_3d_desc(2, 2, 2))
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="no mp_rank_"):
        DeepSpeedCheckpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        DeepSpeedCheckpoint(str(tmp_path / "missing"))
