"""deepspeed.inference.quantization through dslaunch.runtime: the packed integers, scales,
minimums, dequantized weights and quantized layers' outputs DeepSpeed 0.19.8 recorded
(scripts/make_ds_groupquant_fixtures.py), the model walk, and the one-line refusals."""
from collections import OrderedDict

import pytest
import torch
from torch import nn

import dslaunch.runtime  # noqa: F401  (installs the alias table)
from dslaunch.runtime.core.strict import ConfigError
from dslaunch.runtime.inference.quantization import layers, utils
from dslaunch.runtime.inference.quantization.quantization import _init_group_wise_weight_quantization
from repo_paths import DATA
from script_modules import load_script

RECORDED = torch.load(DATA / "ds_groupquant" / "expected.pt")
maker = load_script("make_ds_groupquant_fixtures")


@pytest.fixture(scope="module")
def ours():
    return maker.answer(utils, layers, RECORDED["inputs"])


@pytest.mark.parametrize("case", sorted(maker.CASES))
def test_quantize_matches_deepspeed(ours, case):
    got, want = ours["quantize"][case], RECORDED["expected"]["quantize"][case]
    assert got["q"].dtype == torch.uint8 and torch.equal(got["q"], want["q"])
    torch.testing.assert_close(got["scale"], want["scale"], rtol=0, atol=0)
    torch.testing.assert_close(got["min"], want["min"], rtol=0, atol=0)
    if isinstance(want["dequantized"], str):
        # DeepSpeed has no CPU kernel for this case (maker.NO_CPU_KERNEL); ours is within the bound
        bits, _, _, _, _ = maker.CASES[case]
        w = RECORDED["inputs"]["weights"][case].float()
        step = (1.0 / got["scale"].float()).amax().item()
        assert want["dequantized"] == maker.NO_CPU_KERNEL
        assert (got["dequantized"].float() - w).abs().max().item() <= step / 2 + 1e-2
    else:
        torch.testing.assert_close(got["dequantized"], want["dequantized"], rtol=0, atol=0)


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_quantized_layers_match_deepspeed(ours, bits):
    for kind in ("linear", "embedding"):
        torch.testing.assert_close(ours["layers"][bits][kind], RECORDED["expected"]["layers"][bits][kind],
                                   rtol=2e-3, atol=2e-3)


def _cfg(bits=8, **extra):
    return {"num_bits": bits, "group_size": 16, "group_dim": 0, "symmetric": False, **extra}


def test_model_walk_replaces_the_named_layers():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        [("embed", nn.Embedding(32, 16)), ("proj_in", nn.Linear(16, 32)), ("act", nn.ReLU()),
         ("proj_out", nn.Linear(32, 16)), ("head", nn.Linear(16, 32))])).half()
    ids = torch.tensor([[1, 5, 7]])
    before = model(ids).float()
    out = _init_group_wise_weight_quantization(model, {"weight_quantization": {"post_init_quant": {
        "proj": _cfg(), "embed": _cfg(4)}}})
    assert out is model
    assert type(model.proj_in) is layers.QuantizedLinear and type(model.proj_out) is layers.QuantizedLinear
    assert type(model.embed) is layers.QuantizedEmbedding and type(model.head) is nn.Linear
    assert model.proj_in.qweight.dtype == torch.uint8 and model.embed.qweight.shape == (32, 8)  # int4: 2 per byte
    assert (model(ids).float() - before).abs().max().item() < 0.1


def test_refusals_are_one_line():
    def walk(section, **cfg):
        return _init_group_wise_weight_quantization(nn.Sequential(OrderedDict([("fc", nn.Linear(16, 16))])),
                                                    {"weight_quantization": {"post_init_quant": section}, **cfg})

    cases = [(lambda: walk({"fc": _cfg(), "f": _cfg()}), "matches more than one key"),
             (lambda: walk({"fc": _cfg(symmetric=True)}), "symmetric"),
             (lambda: walk({"fc": _cfg(bits=3)}), "num_bits"),
             (lambda: walk({"fc": _cfg()}, zero_optimization={"stage": 3}), "ZeRO-3"),
             (lambda: _init_group_wise_weight_quantization(nn.Linear(2, 2), {}), "post_init_quant")]
    for call, words in cases:
        with pytest.raises(ConfigError, match=words) as err:
            call()
        assert "\n" not in str(err.value)
