"""AutoTP's universal-checkpoint metadata and the per-sub-parameter layers
(runtime/tensor_parallel/uc_meta.py, subparams.py, autotp_subparam_layers.py, and
train/checkpoint/autotp_restore.py) against DeepSpeed 0.19.8, as recorded in
tests/data/ds_autotp_uc.json (scripts/make_ds_autotp_uc_fixtures.py): for each layer and rank,
the local cut of arange weights, the metadata on each parameter, the model-level info
`collect_autotp_universal_checkpoint_info` publishes (DeepSpeed's affine_map aside: not
produced here), and the piece `_resolve_autotp_partition` restores from the full tensor; then
`_narrow_sub_params` and its refusals. On two ranks: a fused qkv (uneven, GQA-like) and a
row sub-parameter layer equal one process's nn.Linear in forward, gradients, gather_params and
full_state_dict."""
import importlib
import json

import pytest
import torch

import dslaunch.runtime  # noqa: F401  installs the alias table
from dist_harness import run_function
from recorded_values import as_recorded
from repo_paths import DATA
from script_modules import load_script

DS = json.loads((DATA / "ds_autotp_uc.json").read_text())
layers = importlib.import_module("dslaunch.runtime.module_inject.layers")
uc = importlib.import_module("dslaunch.runtime.checkpoint.universal_checkpoint")
constants = importlib.import_module("dslaunch.runtime.checkpoint.constants")
mode = importlib.import_module("dslaunch.runtime.tensor_parallel.mode")
from dslaunch.runtime.core.errors import CheckpointError  # noqa: E402

_full_linear_of = load_script("fused_layer_cases").full_linear  # the weights DeepSpeed's recorded run used


def _spec(value):
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


def _build(case, rank):
    """The layer for `rank`, made the way the fixture script made DeepSpeed's."""
    cls, tp, kw = getattr(layers, case["cls"]), case["tp"], dict(case["kwargs"])
    if "shape" in kw:
        kw["shape"] = _spec(kw["shape"])
    layer = cls(_full_linear_of(case["in"], case["out"], case["bias"]), mp_group=None, **kw)
    layer.tp_world_size, layer.tp_index = tp, rank
    if case["cls"].startswith("SubParamLinear"):
        sizes = layer._subparam_sizes or (layer._logical_shape[layer.partition_dim],)
        layer._subparam_shard_widths = layers._subparam_shard_widths(sizes, tp, layer.tp_meta, layer.name)
    else:
        layer._freeze_partition_sizes(case["out"] if case["cls"] != "LinearAllreduce" else case["in"])
    layer._tp_partition([layer.weight, layer.bias])
    layer._mark_uc_metadata()
    return layer


def test_recorded_from_deepspeed_0_19_8():
    assert DS["deepspeed"].startswith("0.19.8")


@pytest.mark.parametrize("case", DS["layers"], ids=[c["case"] for c in DS["layers"]])
def test_each_rank_cut_metadata_info_and_restore_equal_deepspeeds(case, training_mode):
    for rank, want in enumerate(case["ranks"]):
        layer = _build(case, rank)
        model = torch.nn.Module()
        model.proj = layer
        assert as_recorded(layers.collect_autotp_universal_checkpoint_info(model)) == want["info"], rank
        for pname in ("weight", "bias"):
            param = getattr(layer, pname)
            if param is None:
                assert pname not in want
                continue
            assert param.detach().tolist() == want[pname], (pname, rank)
            assert as_recorded(getattr(param, constants.DS_AUTOTP_UC_META)) == want[f"{pname}_meta"], (pname, rank)
            full = getattr(_full_linear_of(case["in"], case["out"], case["bias"]), pname).detach().flatten()
            piece = uc._resolve_autotp_partition(param, {}, full, rank, case["tp"])
            assert (None if piece is None else piece.tolist()) == want[f"restored_{pname}"], (pname, rank)


@pytest.mark.parametrize("case", DS["narrow"], ids=lambda c: f"{c['sizes']}-tp{c['tp']}-v{c['version']}")
def test_narrow_sub_params_equals_deepspeeds(case):
    full = torch.arange(sum(case["sizes"]) * 3, dtype=torch.float32).view(sum(case["sizes"]), 3)
    got = [uc._narrow_sub_params(full, 0, tuple(case["sizes"]), case["widths"], r, case["tp"], case["version"])
           .tolist() for r in range(case["tp"])]
    assert got == case["ranks"]


def test_refusals_are_one_line_where_deepspeed_refuses():
    recorded = {r["case"]: r for r in DS["refusals"]}
    assert recorded["legacy_uneven"]["error"] == "AssertionError"  # DeepSpeed asserts; we raise one line
    with pytest.raises(CheckpointError,
                       match=r"sizes \[6\] are not divisible by tp_world_size 4.*records no sub_param_shard_widths") as err:
        uc._narrow_sub_params(torch.zeros(10, 2), 0, (6, 4), None, 0, 4, 0.3)
    assert isinstance(err.value, AssertionError)  # as DeepSpeed's assert: scripts catching it still do
    param = torch.nn.Parameter(torch.zeros(6, 4))
    setattr(param, constants.DS_AUTOTP_UC_META,
            layers._build_param_uc_restore_meta(partition_type="column", partition_dim=0, logical_shape=(12, 4),
                                                original_shape=(12, 4), unsupported_reason="a reason"))
    assert recorded["unsupported"]["error"] == "RuntimeError"
    with pytest.raises(RuntimeError, match="a reason") as err:
        uc._resolve_autotp_partition(param, {}, torch.zeros(48), 0, 2)
    assert "\n" not in str(err.value)
    # a sub-parameter description of another parameter is refused, not narrowed
    with pytest.raises(CheckpointError, match="describes another parameter"):
        uc._narrow_sub_params(torch.zeros(9, 2), 0, (4, 4), [[2, 2], [2, 2]], 0, 2, 0.4)


def test_cuts_dslaunch_does_not_provide_are_refused_in_one_line():
    from dslaunch.runtime.tensor_parallel.shard import TensorParallelError
    solo = torch.nn.Linear(4, 4)
    with pytest.raises(TensorParallelError, match="cannot be inferred|does not view"):
        layers.SubParamLinearLayer(solo, mp_group=None, shape=(2, -1, -1), partition_dim=0)
    # CodeGen's fused layout interleaves blocks across ranks: no per-sub-parameter cut describes it
    block = type("CodeGenBlock", (torch.nn.Module,), {})()
    layer = layers.fused_LinearLayer(torch.nn.Linear(4, 12), mp_group=None, fused_module=block)
    with pytest.raises(RuntimeError, match="interleaves or replicates blocks"):
        layer.gather_params([layer.weight, layer.bias])
    layer.tp_world_size = 2
    with pytest.raises(TensorParallelError, match="cannot be split at tp 2"):
        layer._tp_partition([layer.weight, layer.bias])
    yuan = layers.Yuan_LinearLayer(torch.nn.Linear(4, 4), mp_group=None, name="v")
    yuan.tp_world_size = 2
    with pytest.raises(TensorParallelError, match="shard_value_with_share_qk"):
        yuan._tp_partition([yuan.weight, yuan.bias])


def _two_ranks():
    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel import full_state_dict
    mode.set_autotp_mode(training=True)
    group = comm.new_group([0, 1])
    torch.manual_seed(0)
    qkv_full, out_full = torch.nn.Linear(4, 10), torch.nn.Linear(10, 4)
    x = torch.randn(3, 4)
    ref = out_full(qkv_full(x))
    ref.square().sum().backward()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Linear(10, 4))
    # q of 6 and k, v of 2 each: every rank keeps 3 of q and 1 of k and v
    model[0] = layers.SubParamLinearLayer(model[0], group, shape=((6, 2, 2), -1), partition_dim=0, name="qkv")
    model[1] = layers.SubParamLinearAllreduce(model[1], group, shape=(4, (6, 2, 2)), partition_dim=1, name="o")
    out = model(x)
    out.square().sum().backward()
    rank = comm.get_rank(group)
    rows = [r for start, w in ((0, 3), (6, 1), (8, 1)) for r in range(start + rank * w, start + (rank + 1) * w)]
    state = full_state_dict(model)
    full = {"0.weight": qkv_full.weight, "0.bias": qkv_full.bias, "1.weight": out_full.weight,
            "1.bias": out_full.bias}
    w0 = model[0].weight
    w0.gather_params([w0, model[0].bias])
    gathered = (w0 - qkv_full.weight).abs().max().item() + (model[0].bias - qkv_full.bias).abs().max().item()
    w0._tp_partition([w0, model[0].bias])
    return {"out": (out - ref).abs().max().item(),
            "grad0": (model[0].weight.grad - qkv_full.weight.grad[rows]).abs().max().item(),
            "grad1": (model[1].weight.grad - out_full.weight.grad[:, rows]).abs().max().item(),
            "state": {k: (v - full[k]).abs().max().item() for k, v in state.items()},
            "gathered": gathered, "after": (model[0].weight - qkv_full.weight[rows]).abs().max().item()}


def test_two_ranks_of_sub_parameter_layers_equal_one_process():
    for r in run_function(_two_ranks, nprocs=2, timeout=240):
        assert r["out"] < 1e-5 and r["grad0"] < 1e-5 and r["grad1"] < 1e-5
        assert sorted(r["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert max(r["state"].values()) == 0 and r["gathered"] == 0 and r["after"] == 0
