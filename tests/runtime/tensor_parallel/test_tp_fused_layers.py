"""deepspeed.module_inject.layers' fused column layers, GateUpPack_LinearLayer (packed gate+up)
and fused_LinearLayer (fused qkv), and the layer specs' SubParamLinearLayer /
SubParamLinearAllreduce, in runtime/tensor_parallel/autotp_subparam_layers.py, against
DeepSpeed 0.19.8: each rank's block of a full nn.Linear, every sub-parameter split at its own
uneven (kv-head or grain) widths, QWen's attn.split_size, and the layouts refused, as recorded
in tests/data/ds_fused_layers.json (scripts/make_ds_fused_layer_fixtures.py cuts the same
arange weights, scripts/fused_layer_cases.py, with DeepSpeed's own layers). Both calling
conventions are replayed: the model's AutoTPMeta passed in, and tp_shard's module settings.
On two ranks: forward, gradients, gather_params / _tp_partition and full_state_dict equal one
process's nn.Linear."""
import importlib
import json

import pytest
import torch

import dslaunch.runtime  # noqa: F401  installs the alias table
from dist_harness import run_function
from dslaunch.runtime.tensor_parallel.shard import TensorParallelError
from repo_paths import DATA
from script_modules import load_script

DS = json.loads((DATA / "ds_fused_layers.json").read_text())
cases = load_script("fused_layer_cases")
layers = importlib.import_module("dslaunch.runtime.module_inject.layers")
tp_shard = importlib.import_module("dslaunch.runtime.tensor_parallel.tp_shard")


@pytest.fixture
def settings():
    """tp_shard's module settings, restored after the test."""
    saved = (tp_shard.num_kv_heads, tp_shard.num_attention_heads, tp_shard.n_embd, tp_shard.tp_grain_size)
    yield
    for setter, value in zip((tp_shard.set_num_kv_heads, tp_shard.set_num_attention_heads, tp_shard.set_n_embd,
                              tp_shard.set_tp_grain_size), saved):
        setter(value)


def _build(case, tp, rank, convention):
    meta = tp_shard.AutoTPMeta(**case["meta"])
    if convention == "settings":  # DeepSpeed before 0.19.8: the model's numbers in module settings
        tp_shard.set_num_kv_heads(meta.num_kv_heads)
        tp_shard.set_num_attention_heads(meta.num_attention_heads)
        tp_shard.set_n_embd(meta.n_embd)
        tp_shard.set_tp_grain_size(meta.tp_grain_size)
        meta = None
    linear = cases.full_linear(case["in"], case["out"], case["bias"])
    block = None
    if case["kind"] == "gateup":
        layer = layers.GateUpPack_LinearLayer(linear, mp_group=None, name=case["name"], tp_meta=meta)
    else:
        block = cases.block_for(case["block"], case["out"] // 3)
        layer = layers.fused_LinearLayer(linear, None, skip_partition=True, name=case["name"], fused_module=block,
                                         tp_meta=meta)
    layer.tp_world_size, layer.tp_index = tp, rank
    layer._freeze_partition_sizes(case["out"])
    return layer, block


def test_recorded_from_deepspeed_0_19_8():
    assert DS["deepspeed"] == "0.19.8"
    assert len(DS["cases"]) == len(cases.CASES) and len(DS["refused"]) == len(cases.REFUSED)


def test_the_deepspeed_paths_are_our_layers():
    ours = importlib.import_module("dslaunch.runtime.tensor_parallel.autotp_subparam_layers")
    for name in ("GateUpPack_LinearLayer", "fused_LinearLayer", "SubParamColumnParallel", "SubParamLinearLayer",
                 "SubParamLinearAllreduce"):
        assert getattr(layers, name) is getattr(ours, name)


@pytest.mark.parametrize("convention", ["meta", "settings"])
@pytest.mark.parametrize("case", DS["cases"], ids=lambda c: f"{c['kind']}-{c['block']}-out{c['out']}-tp{c['tp']}")
def test_each_ranks_block_equals_deepspeeds(case, convention, training_mode, settings):
    for rank, want in enumerate(case["ranks"]):
        layer, block = _build(case, case["tp"], rank, convention)
        assert list(layer._subparam_sizes) == case["subparam_sizes"]
        assert layer._subparam_shard_widths == case["widths"]
        layer._tp_partition([layer.weight, layer.bias])
        assert layer.weight.detach().tolist() == want["weight"]
        assert (layer.bias.detach().tolist() if layer.bias is not None else None) == want["bias"]
        assert getattr(getattr(block, "attn", None), "split_size", None) == want["split_size"]


def test_the_frozen_widths_ignore_later_settings(training_mode, settings):
    layer, _ = _build(cases.CASES[0], 2, 0, "settings")  # grain 1 from the module settings
    first = torch.nn.Parameter(cases.full_linear(3, 10, False).weight.detach().clone())
    layer._tp_partition([first, None])
    tp_shard.set_tp_grain_size(4)  # a second model's settings
    second = torch.nn.Parameter(cases.full_linear(3, 10, False).weight.detach().clone())
    layer._tp_partition([second, None])
    assert torch.equal(first, second) and first.shape == (6, 3)  # gate [3, 2], up [3, 2]


@pytest.mark.parametrize("case", DS["refused"], ids=lambda c: c["block"])
def test_the_layouts_deepspeed_refuses_are_refused(case, training_mode, settings):
    if case["at"] == "build":
        with pytest.raises(RuntimeError, match="empty query/key/value shard"):
            _build(case, case["tp"], case["rank"], "meta")
        return
    assert "interleaves or replicates blocks" in case["error"]
    layer, _ = _build(case, case["tp"], case["rank"], "meta")
    assert layer._subparam_sizes is None
    with pytest.raises(RuntimeError, match="interleaves or replicates blocks"):
        layer.gather_params([torch.nn.Parameter(torch.zeros(case["out"] // case["tp"], case["in"])), None])
    # and not cut either (a one-line TensorParallelError naming the reason)
    with pytest.raises(TensorParallelError, match="cannot be split at tp .*interleaves or replicates blocks"):
        layer._tp_partition([torch.nn.Parameter(torch.zeros(case["out"], case["in"])), None])


def test_gather_output_and_a_missing_block_are_refused():
    with pytest.raises(Exception, match="gather_output is not provided"):
        layers.GateUpPack_LinearLayer(torch.nn.Linear(2, 4), gather_output=True)
    with pytest.raises(Exception, match="'fused_module' .* is required"):
        layers.fused_LinearLayer(torch.nn.Linear(2, 6), None)


def test_the_shard_map_reassembles_the_stacked_layout(training_mode):
    """ParamShard's sub_widths (what full_state_dict and load_full_ read) inverts the cut."""
    full = cases.full_linear(3, 10, True)
    spec = None
    blocks = []
    for rank in range(2):
        layer, _ = _build(cases.CASES[0], 2, rank, "meta")
        layer._tp_partition([layer.weight, layer.bias])
        layer._configure()
        spec = layer.param_shards()["weight"]
        assert torch.equal(spec.cut(full.weight.detach(), 2, rank), layer.weight.detach())
        blocks.append(layer.weight.detach())
    assert torch.equal(spec.assemble(blocks), full.weight.detach())


def _rank_rows(widths, rank):
    """The full weight's rows `rank` keeps: its piece of each sub-parameter, in order."""
    out, offset = [], 0
    for per_rank in widths:
        start = offset + sum(per_rank[:rank])
        out.append(torch.arange(start, start + per_rank[rank]))
        offset += sum(per_rank)
    return torch.cat(out)


def _two_ranks():
    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel import full_state_dict
    from dslaunch.runtime.tensor_parallel.mode import set_autotp_mode
    from dslaunch.runtime.tensor_parallel.tp_shard import AutoTPMeta
    set_autotp_mode(training=True)
    group = comm.new_group([0, 1])
    rank = comm.get_rank(group)
    out = {}
    # gate+up halves of 5 split [3, 2]; GLM q, k, v of 6 each split by 3 heads as [4, 2]
    for label, fout, make in (
            ("gateup", 10, lambda lin: layers.GateUpPack_LinearLayer(lin, group, name="dense_h_to_4h")),
            ("glm", 18, lambda lin: layers.fused_LinearLayer(lin, group, fused_module=cases.block_for("GLMBlock", 6),
                                                             name="query_key_value",
                                                             tp_meta=AutoTPMeta(num_kv_heads=3)))):
        torch.manual_seed(0)
        full = torch.nn.Linear(6, fout)
        x = torch.randn(4, 6)
        full(x).square().sum().backward()
        lin = torch.nn.Linear(6, fout)
        lin.load_state_dict(full.state_dict())
        layer = make(lin)
        rows = _rank_rows(layer._subparam_shard_widths, rank)
        y = layer(x)
        y.square().sum().backward()
        model = torch.nn.Sequential(layer)
        state = full_state_dict(model)
        layer.weight.gather_params([layer.weight, layer.bias])
        gathered = (layer.weight.detach().clone(), layer.bias.detach().clone())
        layer.weight._tp_partition([layer.weight, layer.bias])
        shard = layer.bias.detach().clone()
        layer.bias.gather_params([layer.bias])  # DeepSpeed's engine hands one parameter at a time
        bias_alone = (layer.bias.detach() - full.bias).abs().max().item()
        layer.bias._tp_partition([layer.bias])
        out[label] = {"bias_alone": bias_alone, "bias_back": torch.equal(layer.bias.detach(), shard),
            "out": (y - full(x)[:, rows]).abs().max().item(),
            "grad": (layer.weight.grad - full.weight.grad[rows]).abs().max().item(),
            "bias_grad": (layer.bias.grad - full.bias.grad[rows]).abs().max().item(),
            "state": max((state["0.weight"] - full.weight).abs().max().item(),
                         (state["0.bias"] - full.bias).abs().max().item()),
            "gathered": max((gathered[0] - full.weight).abs().max().item(),
                            (gathered[1] - full.bias).abs().max().item()),
            "shape": tuple(layer.weight.shape), "rows": rows.tolist()}
    return out


def test_two_ranks_equal_one_process():
    ranks = run_function(_two_ranks, nprocs=2, timeout=240)
    assert [r["gateup"]["rows"] for r in ranks] == [[0, 1, 2, 5, 6, 7], [3, 4, 8, 9]]
    assert [r["glm"]["shape"] for r in ranks] == [(12, 6), (6, 6)]
    for r in ranks:
        for got in r.values():
            assert got["out"] < 1e-5 and got["grad"] < 1e-5 and got["bias_grad"] < 1e-5
            assert got["state"] == 0 and got["gathered"] == 0 and got["bias_alone"] == 0 and got["bias_back"]


@pytest.mark.parametrize("case", DS["shaped"], ids=lambda c: f"{c['kind']}-{c['name']}-tp{c['tp']}")
def test_a_layer_specs_shape_splits_as_deepspeeds(case, training_mode, settings):
    meta = tp_shard.AutoTPMeta(**case["meta"])
    column = case["kind"] == "column"
    cls = layers.SubParamLinearLayer if column else layers.SubParamLinearAllreduce
    for rank, want in enumerate(case["ranks"]):
        layer = cls(cases.full_linear(case["in"], case["out"], True), None, shape=case["shape"],
                    partition_dim=0 if column else 1, name=case["name"], tp_meta=meta)
        layer.tp_world_size, layer.tp_index = case["tp"], rank
        layer._freeze_partition_sizes(case["out"] if column else case["in"])
        # a -1 at the partition dim is one block: no sub-parameter sizes, as DeepSpeed reports
        sizes = layer._subparam_sizes
        assert (list(sizes) if sizes is not None else None) == case["subparam_sizes"]
        assert layer._subparam_shard_widths == case["widths"]
        layer._tp_partition([layer.weight, layer.bias])
        assert layer.weight.detach().tolist() == want["weight"] and layer.bias.detach().tolist() == want["bias"]


def test_a_shape_that_does_not_fit_is_refused():
    with pytest.raises(TensorParallelError, match="sum to 15, not the weight's 16"):
        layers.SubParamLinearLayer(torch.nn.Linear(2, 16), None, shape=((8, 4, 3), -1))
    # deeper views (heads x head_dim x in) are provided; one that cannot view the weight is refused
    with pytest.raises(TensorParallelError, match="cannot be inferred"):
        layers.SubParamLinearLayer(torch.nn.Linear(2, 16), None, shape=(3, 8, -1))
    with pytest.raises(TensorParallelError, match="does not split into 3 equal"):
        layers.SubParamLinearAllreduce(torch.nn.Linear(16, 2), None, shape=(-1, 3))


def _two_ranks_shaped():
    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel import full_state_dict
    from dslaunch.runtime.tensor_parallel.mode import set_autotp_mode
    set_autotp_mode(training=True)
    group = comm.new_group([0, 1])
    torch.manual_seed(0)
    qkv_full, o_full = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    x = torch.randn(3, 8)
    ref = o_full(qkv_full(x))
    ref.square().sum().backward()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    model[0] = layers.SubParamLinearLayer(model[0], group, shape=((8, 4, 4), -1), name="self_attn.qkv_proj")
    model[1] = layers.SubParamLinearAllreduce(model[1], group, shape=(-1, (8, 4, 4)), name="self_attn.o_proj")
    out = model(x)  # the column block's q, k, v pieces are exactly the row block's input columns
    out.square().sum().backward()
    state = full_state_dict(model)
    full = {"0.weight": qkv_full.weight, "0.bias": qkv_full.bias, "1.weight": o_full.weight, "1.bias": o_full.bias}
    weight, bias = model[1].weight, model[1].bias
    model[1].gather_params([weight])
    gathered = (weight.detach() - o_full.weight).abs().max().item()
    model[1]._tp_partition([weight])
    model[1].gather_params([bias])  # the row layer's bias is whole: left alone
    return {"out": (out - ref).abs().max().item(), "bias_grad": (bias.grad - o_full.bias.grad).abs().max().item(),
            "state": max((state[k] - v).abs().max().item() for k, v in full.items()), "gathered": gathered,
            "shapes": [tuple(model[0].weight.shape), tuple(weight.shape), tuple(bias.shape)]}


def test_two_ranks_shaped_layers_equal_one_process():
    ranks = run_function(_two_ranks_shaped, nprocs=2, timeout=240)
    for r in ranks:
        assert r["shapes"] == [(8, 8), (8, 8), (8,)]
        assert r["out"] < 1e-5 and r["bias_grad"] < 1e-5 and r["state"] == 0 and r["gathered"] == 0
