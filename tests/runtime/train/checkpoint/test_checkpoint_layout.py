"""Checkpoint layout, pure: DeepSpeed's file names with real ranks, tag validation, and a
`latest` that is never followed outside the save directory."""
import os

import pytest

from dslaunch.runtime.checkpoint import CheckpointError
from dslaunch.runtime.checkpoint.layout import (LAYER, MODEL, OPTIM, RNG, ZERO_MODEL, file_name, read_latest,
                                                slice_rank, tag_problem, validate_tag)


@pytest.mark.parametrize("kwargs,name", [
    ({"kind": MODEL}, "mp_rank_00_model_states.pt"),
    ({"kind": MODEL, "pp_rank": 1}, "mp_rank_01_model_states.pt"),  # pipeline stage 1, no model parallelism
    ({"kind": MODEL, "pp_rank": 1, "mp_rank": 1, "mp_world_size": 2}, "mp_rank_03_model_states.pt"),
    ({"kind": ZERO_MODEL, "dp_rank": 3}, "zero_pp_rank_3_mp_rank_00_model_states.pt"),
    ({"kind": OPTIM, "dp_rank": 12}, "zero_pp_rank_12_mp_rank_00_optim_states.pt"),
    ({"kind": OPTIM, "dp_rank": 1, "pp_rank": 1, "bf16": True}, "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"),
    ({"kind": LAYER, "layer": 7}, "layer_07-model_states.pt"),
    ({"kind": LAYER, "layer": 123}, "layer_123-model_states.pt"),
    ({"kind": LAYER, "layer": 2, "pp_rank": 1, "mp_rank": 1, "mp_world_size": 2}, "layer_02-model_01-model_states.pt"),
    ({"kind": RNG, "global_rank": 5}, "rng_state_rank_5.pt"),
])
def test_file_names_are_deepspeeds(kwargs, name):
    kind = kwargs.pop("kind")
    assert file_name(kind, **kwargs) == name


def test_slice_rank_is_deepspeeds_pipe_model_order():
    # PipelineParallelGrid: the ranks sharing a data coordinate, sorted, in (pipe, model) order
    assert [slice_rank(p, m, 2) for p in range(2) for m in range(2)] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        file_name("bogus")
    with pytest.raises(ValueError):
        file_name(LAYER)


@pytest.mark.parametrize("tag,problem", [
    ("", "is empty"),
    (" step1", "has leading or trailing whitespace"),
    ("step1\n", "has leading or trailing whitespace"),
    ("latest", "is reserved"),
    ("..", "is not a directory name"),
    (".", "is not a directory name"),
    ("a/b", "contains a path separator"),
    ("a\\b", "contains a path separator"),
    ("/abs", "contains a path separator"),
    ("x..y", "contains '..'"),
    (".tmp.step1", "starts with '.'"),
    ("a\tb", "contains a control character"),
    ("x" * 201, "is longer than 200 bytes"),
])
def test_bad_tags_are_refused_with_the_reason(tag, problem):
    assert problem in tag_problem(tag)
    with pytest.raises(CheckpointError) as info:
        validate_tag(tag, "save_checkpoint tag")
    assert str(info.value) == f"checkpoint save_checkpoint tag {tag!r} {tag_problem(tag)}"


def test_good_tags_pass():
    for tag in ("global_step10", "epoch-3.best", "run 1", 42):
        assert validate_tag(tag) == str(tag)


def test_latest_is_never_followed_outside_the_save_dir(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    assert read_latest(str(root)) is None
    (root / "latest").write_text("global_step3\n")
    assert read_latest(str(root)) == "global_step3"
    (root / "latest").write_text(".old.global_step3")  # the pointer a save in progress leaves
    assert read_latest(str(root)) == ".old.global_step3"

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    for content, why in [("../elsewhere", "contains a path separator"), (str(outside), "contains a path separator"),
                         ("..", "is not a directory name"), ("", "is empty"), ("latest", "is reserved"),
                         ("escape", f"resolves to {outside}, outside {root}")]:
        (root / "latest").write_text(content)
        with pytest.raises(CheckpointError) as info:
            read_latest(str(root))
        msg = str(info.value)
        assert msg.startswith(f"{root}/latest names {content.strip()!r}") and why in msg and "\n" not in msg, msg
    (root / "latest").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match="is not a text file naming a tag"):
        read_latest(str(root))
