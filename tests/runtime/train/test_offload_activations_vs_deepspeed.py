"""CheckpointHiddenStatesOffload's stats against DeepSpeed 0.19.8's recorded counts
(tests/data/ds_offload_activations.json, by scripts/make_ds_offload_activations_fixtures.py
over scripts/offload_activations_cases.py): the same cases run with dslaunch give the same
counts, on the plain CPU (nothing moves) and with the host standing in for a device (the
offload path runs: keep-last, the byte threshold, views, retain_graph, the buffer pool)."""
import json

import pytest

from repo_paths import DATA
from script_modules import load_script

import dslaunch.runtime  # noqa: F401  (puts DeepSpeed's module paths in place)
from dslaunch.runtime.core.accelerator import get_accelerator
from dslaunch.runtime.train.activation_checkpointing import offload_activations

cases = load_script("offload_activations_cases")
DS = json.loads((DATA / "ds_offload_activations.json").read_text())


@pytest.fixture(scope="module")
def ours():
    return cases.run_all(offload_activations, get_accelerator())


def test_the_record_is_deepspeeds_and_covers_every_case(ours):
    assert DS["deepspeed"] == "0.19.8"
    assert {g: sorted(c) for g, c in DS["cases"].items()} == {g: sorted(c) for g, c in ours.items()}
    # the record is not vacuous: the offload path moved tensors on DeepSpeed's side
    assert DS["cases"]["host_as_device"]["chain-k0"]["offloaded_tensors"] == 4
    assert DS["cases"]["cpu"]["chain-k0"]["skipped_marked_tensors"] == 4


@pytest.mark.parametrize("group,name", [(g, n) for g, c in sorted(DS["cases"].items()) for n in sorted(c)])
def test_stats_match_deepspeed(ours, group, name):
    assert ours[group][name] == DS["cases"][group][name]


def test_the_deepspeed_path_is_this_module():
    import importlib

    ds = importlib.import_module("dslaunch.runtime.activation_checkpointing.offload_activations")
    assert ds is offload_activations
    assert ds.get_checkpoint_hidden_states_offloading_ctx_manager is \
        offload_activations.get_checkpoint_hidden_states_offloading_ctx_manager
