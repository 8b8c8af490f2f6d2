"""deepspeed.module_inject.layers' LinearLayer and LinearAllreduce (runtime/tensor_parallel/
autotp_layers.py) against DeepSpeed 0.19.8: each rank's block of a full nn.Linear, uneven
splits included, as recorded in tests/data/ds_tp_layers.json (scripts/make_ds_tp_layer_fixtures.py,
which cuts the same arange weights with DeepSpeed's own layers); and on two ranks, that the
forward, the gradients, gather_params / _tp_partition and full_state_dict equal one process's
nn.Linear."""
import importlib
import json

import pytest
import torch

import dslaunch.runtime  # noqa: F401  installs the alias table
from dist_harness import run_function
from repo_paths import DATA

DS = json.loads((DATA / "ds_tp_layers.json").read_text())
layers = importlib.import_module("dslaunch.runtime.module_inject.layers")
mode = importlib.import_module("dslaunch.runtime.tensor_parallel.mode")


def _full_linear(fin, fout):
    lin = torch.nn.Linear(fin, fout)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(fout * fin, dtype=torch.float32).view(fout, fin))
        lin.bias.copy_(torch.arange(fout, dtype=torch.float32) + 1000)
    return lin


def test_recorded_from_deepspeed_0_19_8():
    assert DS["deepspeed"] == "0.19.8"


def test_the_deepspeed_path_is_our_layers():
    ours = importlib.import_module("dslaunch.runtime.tensor_parallel.autotp_layers")
    assert layers.LinearLayer is ours.LinearLayer and layers.LinearAllreduce is ours.LinearAllreduce
    assert layers.set_autotp_mode is mode.set_autotp_mode


@pytest.mark.parametrize("case", DS["cases"], ids=lambda c: f"{c['kind']}-{c['out']}x{c['in']}-tp{c['tp']}")
def test_each_ranks_block_equals_deepspeeds(case, training_mode):
    cls = layers.LinearLayer if case["kind"] == "column" else layers.LinearAllreduce
    for rank, expected in enumerate(case["ranks"]):
        layer = cls(_full_linear(case["in"], case["out"]), mp_group=None, name=case["name"])
        # as DeepSpeed's script did: a group's size and rank given by hand, then re-cut
        layer.tp_world_size, layer.tp_index = case["tp"], rank
        sizes = layer._freeze_partition_sizes(case["out"] if case["kind"] == "column" else case["in"])
        assert list(sizes) == case["sizes"]
        layer._tp_partition([layer.weight, layer.bias])
        assert layer.weight.tolist() == expected["weight"]
        assert layer.bias.tolist() == expected["bias"]


def test_a_layer_alone_keeps_the_whole_module(training_mode):
    lin = torch.nn.Linear(3, 5)
    layer = layers.LinearLayer(lin, mp_group=None)
    assert layer.weight is lin.weight and layer.weight.shape == (5, 3) and layer.tp_world_size == 1
    x = torch.randn(2, 3)
    torch.testing.assert_close(layer(x), lin(x))
    assert layer.weight.requires_grad and layer.weight.tensor_model_parallel


def test_outside_training_mode_the_parameters_are_frozen():
    was = mode.is_autotp_training_mode()
    mode.set_autotp_mode(training=False)
    try:
        layer = layers.LinearAllreduce(torch.nn.Linear(3, 5), mp_group=None)
    finally:
        mode.set_autotp_mode(training=was)
    assert not layer.weight.requires_grad and not layer.bias.requires_grad


def test_a_module_without_a_matrix_weight_is_refused():
    with pytest.raises(Exception, match="LinearLayer: LayerNorm has no 2-D weight"):
        layers.LinearLayer(torch.nn.LayerNorm(4), mp_group=None)


def _two_ranks(fin, fout, gather_output):
    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel import full_state_dict
    from dslaunch.runtime.tensor_parallel.mode import set_autotp_mode
    set_autotp_mode(training=True)
    group = comm.new_group([0, 1])
    torch.manual_seed(0)
    col_full, row_full = torch.nn.Linear(fin, fout), torch.nn.Linear(fout, fin)
    x = torch.randn(3, fin)
    ref = row_full(col_full(x))
    ref.square().sum().backward()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(fin, fout), torch.nn.Linear(fout, fin))
    model[0] = layers.LinearLayer(model[0], group, gather_output=gather_output)
    model[1] = layers.LinearAllreduce(model[1], group)
    if gather_output:  # the row layer then takes this rank's block of the gathered input
        rank = comm.get_rank(group)
        start = sum(model[1]._partition_sizes[:rank])
        hidden = model[0](x).narrow(-1, start, model[1]._partition_sizes[rank])
        out = model[1](hidden)
    else:
        out = model(x)
    out.square().sum().backward()
    state = full_state_dict(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    weight = model[0].weight
    weight.gather_params([weight, model[0].bias])
    gathered = weight.detach().clone()
    weight._tp_partition([weight, model[0].bias])
    return {"out": (out - ref).abs().max().item(), "shape0": tuple(model[0].weight.shape),
            "state": {k: (v - dict(zip(("0.weight", "0.bias", "1.weight", "1.bias"),
                                       (col_full.weight, col_full.bias, row_full.weight, row_full.bias)))[k]
                          ).abs().max().item() for k, v in state.items()},
            "grad0": (grads["0.weight"] - col_full.weight.grad.split(model[0]._partition_sizes)[
                comm.get_rank(group)]).abs().max().item(),
            "grad1": (grads["1.weight"] - row_full.weight.grad.split(model[1]._partition_sizes, dim=1)[
                comm.get_rank(group)]).abs().max().item(),
            "bias1": (grads["1.bias"] - row_full.bias.grad).abs().max().item(),
            "gathered": (gathered - col_full.weight).abs().max().item(),
            "after": tuple(model[0].weight.shape)}


@pytest.mark.parametrize("gather_output", [False, True])
def test_two_ranks_equal_one_process_with_uneven_blocks(gather_output):
    ranks = run_function(_two_ranks, nprocs=2, kwargs={"fin": 4, "fout": 11, "gather_output": gather_output},
                         timeout=240)
    assert [r["shape0"] for r in ranks] == [(6, 4), (5, 4)]  # DeepSpeed's [6, 5] split of 11
    for r in ranks:
        assert r["out"] < 1e-5 and r["grad0"] < 1e-5 and r["grad1"] < 1e-5 and r["bias1"] < 1e-5
        assert max(r["state"].values()) == 0 and sorted(r["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert r["gathered"] == 0 and r["after"] == r["shape0"]


class _PreSplit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(4, 11), torch.nn.Linear(11, 4)

    def forward(self, x):
        return self.down(self.up(x)).square().mean()


def _engine_with_hand_split_layers():
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel.mode import set_autotp_mode
    set_autotp_mode(training=True)
    torch.manual_seed(0)
    model = _PreSplit()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    group = comm.new_group([0, 1])
    model.up = layers.LinearLayer(model.up, group)
    model.down = layers.LinearAllreduce(model.down, group)
    mine = model.up.weight.detach().clone()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "tensor_parallel": {"autotp_size": 2}})
    state = engine._consolidated_16bit_state_dict()
    return {"kept": torch.equal(engine.module.up.weight.detach(), mine), "autotp_size": engine.autotp_size(),
            "state": None if state is None else {k: torch.equal(v, full[k]) for k, v in state.items()}}


def test_an_engine_keeps_hand_split_layers_and_consolidates_them():
    r0, r1 = run_function(_engine_with_hand_split_layers, nprocs=2, timeout=240)
    # rank 1's own block survives initialize (nothing of a split layer is broadcast from rank 0)
    assert r0["kept"] and r1["kept"] and r0["autotp_size"] == 2
    assert r0["state"] == {"up.weight": True, "up.bias": True, "down.weight": True, "down.bias": True}
    assert r1["state"] is None


def _consolidate_unsplit():
    import dslaunch.runtime as deepspeed
    engine, *_ = deepspeed.initialize(model=_PreSplit(), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        engine._consolidated_16bit_state_dict()
    except ValueError as exc:
        return str(exc)
    return None


def test_consolidating_unsplit_weights_is_refused_as_deepspeed_does():
    (line,) = run_function(_consolidate_unsplit, nprocs=1, timeout=120)
    assert line.startswith("consolidated_16bit_state_dict needs split weights")
