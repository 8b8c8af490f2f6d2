"""DeepSpeed's AutoEP module paths (compat/paths.py): the layer class a script checks with
isinstance is the one dslaunch's AutoEP swaps in, with the attributes DeepSpeed's layer has
(router, experts, ep_group_name "ep_size_<N>", expert parameters marked with it); DeepSpeed's
internal AutoEP modules, its folding modules and its AutoEP universal conversion are each one
ImportError line saying why."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

from dslaunch.runtime.config import DeepSpeedConfig
from script_modules import load_script

fx = load_script("make_ds_autoep_fixtures")


def _swapped_mixtral():
    from dslaunch.runtime.moe import autoep
    from dslaunch.runtime.moe.autoep.convert import swap

    cfg = DeepSpeedConfig.load({"train_batch_size": 2, "expert_parallel": {"enabled": True}}).expert_parallel
    ref = fx.make_model("mixtral")
    model = copy.deepcopy(ref)
    swap(model, autoep.detect(model, cfg), cfg, 1, 0, None)
    return ref, model


def test_the_swapped_layers_are_deepspeeds_autoep_layer_class():
    from dslaunch.runtime.module_inject.auto_ep_layer import AutoEPMoELayer

    ref, model = _swapped_mixtral()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]
    blocks = [n for n, m in ref.named_modules() if type(m).__name__ == "MixtralSparseMoeBlock"]
    assert [n for n, _ in layers] == blocks and blocks
    for name, layer in layers:
        assert layer.ep_group_name == "ep_size_1"  # DeepSpeed's f"ep_size_{ep_size}"
        assert layer.router is layer.get_submodule("gate")  # the block's router, under its own name
        assert all(p.group_name == layer.ep_group_name and p.allreduce is False for p in layer.experts.parameters())
        assert not any(hasattr(p, "group_name") for p in layer.router.parameters())
    ids = torch.cat([fx.batch(0, 0), fx.batch(0, 1)])
    assert torch.allclose(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rel,words", [
    ("module_inject.auto_ep_config", "expert_parallel section"),
    ("moe.ep_repack", "expert_parallel section"),
    ("module_inject.auto_ep_folding", "AutoEP + AutoTP folding is not supported"),
    ("moe.ep_tp_dispatch", "AutoEP + AutoTP folding is not supported"),
    ("checkpoint.autoep_universal", "loads at the autoep_size that saved it"),
])
def test_deepspeeds_internal_autoep_paths_are_refused_saying_why(rel, words):
    with pytest.raises(ImportError) as err:
        importlib.import_module(f"dslaunch.runtime.{rel}")
    text = str(err.value)
    assert "\n" not in text and f"deepspeed.{rel}" in text and words in text


def test_deepspeeds_other_names_in_the_layer_module_are_refused_saying_why():
    import dslaunch.runtime.module_inject.auto_ep_layer as layer_module

    with pytest.raises(ImportError) as err:
        from dslaunch.runtime.module_inject.auto_ep_layer import combine_from_routed  # noqa: F401
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("deepspeed.module_inject.auto_ep_layer.combine_from_routed is not provided: ")
    assert "expert_parallel section" in text
    # probes of dunder names stay plain attribute misses (hasattr, the import system)
    assert not hasattr(layer_module, "__path__") and not hasattr(layer_module, "__wrapped__")
