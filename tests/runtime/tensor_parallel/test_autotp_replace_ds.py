"""DeepSpeed's AutoTP class and its per-head helpers (deepspeed.module_inject.auto_tp and
.auto_tp_model_utils: runtime/tensor_parallel/autotp_replace.py, head_helpers.py) against
DeepSpeed 0.19.8, as recorded in tests/data/ds_autotp_replace.json
(scripts/make_ds_autotp_replace_fixtures.py): the walk of a small decoder under a
partition_config for every rank of a 2- and a 3-rank group (each module's class, local values,
divided attributes, the sliced embedding's metadata) and BLOOM's ALiBi tensors; then the head
helpers' cuts and both calling conventions, the tie fallback, update_mp_params' rule, what is
refused, and on two ranks (deepspeed.utils.groups._init_tp_mesh_device) a column/row pair
AutoTP built computing what one process's layers compute."""
import importlib
import json

import pytest
import torch
from torch import nn

import dslaunch.runtime  # noqa: F401  installs the alias table
from dist_harness import run_function
from recorded_values import as_recorded
from repo_paths import DATA
from script_modules import load_script

DS = json.loads((DATA / "ds_autotp_replace.json").read_text())
cases = load_script("autotp_replace_cases")
auto_tp = importlib.import_module("dslaunch.runtime.module_inject.auto_tp")
utils = importlib.import_module("dslaunch.runtime.module_inject.auto_tp_model_utils")
layers = importlib.import_module("dslaunch.runtime.module_inject.layers")
tp_shard = importlib.import_module("dslaunch.runtime.module_inject.tp_shard")
mode = importlib.import_module("dslaunch.runtime.tensor_parallel.mode")
from dslaunch.runtime.core import comm  # noqa: E402
from dslaunch.runtime.core.config.partition import TensorParallelError  # noqa: E402
from dslaunch.runtime.tensor_parallel.uc_keys import DS_AUTOTP_UC_META  # noqa: E402

AutoTP, AutoTPConfig = auto_tp.AutoTP, auto_tp.AutoTPConfig


@pytest.fixture
def fake_groups(monkeypatch):
    """comm answers get_rank / get_world_size for the stand-in groups, as the recording did."""
    get_rank, get_world_size = cases.fake_comm(comm, comm.get_rank, comm.get_world_size)
    monkeypatch.setattr(comm, "get_rank", get_rank)
    monkeypatch.setattr(comm, "get_world_size", get_world_size)
    was = mode.is_autotp_training_mode()
    mode.set_autotp_mode(training=False)  # the recording's mode (DeepSpeed's default): frozen layers
    yield
    mode.set_autotp_mode(training=was)


def _autotp(model, config=None, **kwargs):
    return AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
                  orig_layer_impl=None, partition_config=config, **kwargs)


@pytest.mark.parametrize("walk", DS["walks"], ids=lambda w: f"tp{w['tp']}")
def test_the_walk_matches_deepspeed_on_every_rank(walk, fake_groups):
    for rank, expected in enumerate(walk["ranks"]):
        model = cases.Decoder()
        autotp = _autotp(model, AutoTPConfig.from_dict(DS["partition_config"]), model_config=model.config)
        autotp.set_tensor_parallel_config(walk["tp"], cases.FakeGroup(walk["tp"], rank))
        autotp.update_linear_policies()
        assert autotp._replace_module(model) is model
        got = cases.record(model)
        got["embed_tokens"]["uc_meta"] = as_recorded(getattr(model.embed_tokens.weight, DS_AUTOTP_UC_META))
        assert got == expected, f"tp {walk['tp']} rank {rank}"


@pytest.mark.parametrize("case", DS["alibi"], ids=lambda c: f"{c['heads']}heads")
def test_bloom_alibi_matches_deepspeed(case, monkeypatch):
    monkeypatch.setattr(comm, "is_initialized", lambda: False)
    out = utils.build_bloom_alibi_tensor(torch.tensor(case["mask"]), case["heads"], torch.float32)
    assert list(out.shape) == case["shape"]
    assert out.reshape(-1).tolist() == pytest.approx(case["values"], rel=1e-6, abs=1e-7)


def test_bloom_alibi_keeps_this_ranks_heads_of_the_recorded_split(fake_groups, monkeypatch):
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    case = next(c for c in DS["alibi"] if c["heads"] == 6)
    batch, seq = len(case["mask"]), len(case["mask"][0])
    full = torch.tensor(case["values"]).view(batch, 6, seq)
    sizes = [4, 2]  # 6 heads in 3 kv groups over 2 ranks
    for rank, first in ((0, 0), (1, 4)):
        out = utils.build_bloom_alibi_tensor(torch.tensor(case["mask"]), sizes[rank], torch.float32,
                                             mp_group=cases.FakeGroup(2, rank), head_shard_sizes=sizes,
                                             total_num_heads=6)
        expected = full[:, first:first + sizes[rank]].reshape(batch * sizes[rank], 1, seq)
        torch.testing.assert_close(out, expected)


class _Mpt(nn.Module):

    def build_mpt_alibi_tensor(self, heads, sequence_length, alibi_bias_max=8, device=None):
        return torch.arange(heads, dtype=torch.float32).view(heads, 1, 1).expand(heads, 1, sequence_length)


_MPT_OWN = vars(_Mpt)["build_mpt_alibi_tensor"]


@pytest.mark.parametrize("convention", ["meta", "head counts"])
def test_installed_helpers_freeze_the_split_and_leave_the_class_alone(convention, fake_groups, monkeypatch):
    monkeypatch.setattr(comm, "is_initialized", lambda: True)
    for rank, (local, first) in enumerate(((4, 0), (2, 4))):
        group = cases.FakeGroup(2, rank)
        model = _Mpt()
        if convention == "meta":
            meta = tp_shard.AutoTPMeta(num_kv_heads=3, num_attention_heads=6)
            utils.install_head_sharded_helper(model, "build_mpt_alibi_tensor", utils.build_mpt_alibi_tensor, meta,
                                              group)
        else:
            utils.install_head_sharded_helper(model, "build_mpt_alibi_tensor", utils.build_mpt_alibi_tensor,
                                              mp_group=group, num_heads=6, num_kv_heads=3)
        tp_shard.set_num_kv_heads(2)  # another model's setting must not move this one's split
        try:
            out = model.build_mpt_alibi_tensor(local, 3)
        finally:
            tp_shard.set_num_kv_heads(None)
        assert out[:, 0, 0].tolist() == list(range(first, first + local))
        # installing twice does not wrap the wrapper; the class and a fresh instance keep theirs
        utils.install_head_sharded_helper(model, "build_mpt_alibi_tensor", utils.build_mpt_alibi_tensor,
                                          mp_group=group, num_heads=6, num_kv_heads=3)
        assert model.build_mpt_alibi_tensor(local, 3)[:, 0, 0].tolist() == list(range(first, first + local))
        assert vars(_Mpt)["build_mpt_alibi_tensor"] is _MPT_OWN
        assert _Mpt().build_mpt_alibi_tensor(6, 3).shape[0] == 6


def test_alibi_mask_is_computed_for_all_heads_then_cut(fake_groups, monkeypatch):
    monkeypatch.setattr(comm, "is_initialized", lambda: True)

    class Baichuan(nn.Module):

        def __init__(self):
            super().__init__()
            self.n_head = 5

        def get_alibi_mask(self, tensor, seq):
            self.seen = self.n_head
            return torch.arange(self.n_head, dtype=torch.float32).view(-1, 1, 1).expand(-1, seq, seq)

    for rank, (local, first) in enumerate(((3, 0), (2, 3))):
        model = Baichuan()
        utils.install_head_sharded_helper(model, "get_alibi_mask", utils.get_alibi_mask,
                                          mp_group=cases.FakeGroup(2, rank), num_heads=5, num_kv_heads=5)
        model.n_head = local  # AutoTP's division of the attribute
        mask = model.get_alibi_mask(None, 3)
        assert model.seen == 5 and model.n_head == local
        assert mask.shape == (local, 3, 3) and mask[:, 0, 0].tolist() == list(range(first, first + local))


def test_gathered_column_head_tied_to_the_embedding_stays_whole():
    model = cases.Decoder()
    model.lm_head.weight = model.embed_tokens.weight
    config = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r"lm_head\.weight$"], "partition_type": "column",
                                                      "gather_output": True}]})
    autotp = _autotp(model, config)
    autotp.set_tensor_parallel_config(1, None)
    autotp._replace_module(model)
    assert type(model.lm_head) is nn.Linear and type(model.embed_tokens) is nn.Embedding
    assert model.lm_head.weight is model.embed_tokens.weight


def test_full_paths_and_first_match_and_strict_mode():
    model = cases.Decoder()
    config = AutoTPConfig.from_dict({"layer_specs": [
        {"patterns": [r"layers\.1\.self_attn\.q_proj\.weight$"], "partition_type": "skip"},
        {"patterns": [r"layers\.\d+\.self_attn\.q_proj\.weight$"], "partition_type": "column"}]})
    autotp = _autotp(model, config)
    autotp.set_tensor_parallel_config(1, None)
    autotp._replace_module(model)
    assert isinstance(model.layers[0].self_attn.q_proj, layers.LinearLayer)
    assert type(model.layers[1].self_attn.q_proj) is nn.Linear
    assert type(model.layers[0].self_attn.k_proj) is nn.Linear  # no spec: left as it is
    strict = AutoTPConfig.from_dict({"strict_mode": True, "layer_specs": [
        {"patterns": [r".*q_proj\.weight$"], "partition_type": "column"}]})
    with pytest.raises(ValueError, match=r"No matching spec for layers\.0\.self_attn\.k_proj\.weight"):
        _autotp(cases.Decoder(), strict)._replace_module(cases.Decoder())


def test_update_mp_params_leaves_a_module_with_nothing_split_whole():
    # DeepSpeed 0.19.8: attributes are divided only below a split parameter (its tree before
    # that divided them on any module, which DeepSpeed's unit tests of that tree expect)
    autotp = object.__new__(AutoTP)
    autotp.mp_group, autotp.mp_size = None, 2
    child = nn.Module()
    child.num_heads = 12
    autotp.update_mp_params(child)
    assert child.num_heads == 12 and child.replaced


@pytest.mark.parametrize("kwargs, message", [
    ({"state_dict": {}}, "state_dict"),
    ({"keep_module_on_host": True}, "keep_module_on_host is not provided"),
    ({"vocab_parallel_lm_head": True}, "vocab_parallel_lm_head is not provided"),
    ({"partition_config": {"layer_specs": []}}, "must be an AutoTPConfig"),
])
def test_what_is_not_provided_is_refused_in_one_line(kwargs, message):
    args = dict(module=cases.Decoder(), all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
                orig_layer_impl=None)
    args.update(kwargs)
    with pytest.raises(TensorParallelError, match=message) as info:
        AutoTP(**args)
    assert "\n" not in str(info.value)


def test_name_heuristics_and_training_row_heads_are_refused():
    model = cases.Decoder()
    autotp = _autotp(model)
    autotp.set_tensor_parallel_config(1, None)
    autotp.update_linear_policies()
    with pytest.raises(TensorParallelError, match="name heuristics .* is not provided; give a partition_config"):
        autotp._replace_module(model)
    config = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r"lm_head\.weight$"], "partition_type": "row"}]})
    autotp = _autotp(cases.Decoder(), config, training_mode=True)
    autotp.set_tensor_parallel_config(1, None)
    with pytest.raises(TensorParallelError, match="row-parallel output head in training mode is not provided"):
        autotp._replace_module(autotp.module)


def _two_rank_job():
    from dslaunch.runtime.core import comm as c
    from dslaunch.runtime.module_inject.auto_tp import AutoTP, AutoTPConfig
    from dslaunch.runtime.utils import groups

    c.init_distributed()
    groups._init_tp_mesh_device(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 4), nn.LayerNorm(4))
    reference = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 4), nn.LayerNorm(4))
    reference.load_state_dict(model.state_dict())
    config = AutoTPConfig.from_dict({"layer_specs": [
        {"patterns": [r"0\.weight$"], "partition_type": "column"},
        {"patterns": [r"1\.weight$"], "partition_type": "row"},
        {"patterns": [r"2\.weight$"], "partition_type": "skip", "grad_allreduce": True}]})
    autotp = AutoTP(module=model, all_reduce_linears=[], prefix="", state_dict=None, linear_layer_setting=None,
                    orig_layer_impl=None, partition_config=config)
    autotp.set_tensor_parallel_config(2, groups.get_tensor_model_parallel_group())
    autotp.update_linear_policies()
    autotp._replace_module(model)
    autotp.register_replicated_grad_hooks(model)
    x = torch.randn(3, 6)  # the same on both ranks, as a tensor group's input is
    with torch.no_grad():
        out, ref = model(x), reference(x)
    # the norm applied to rank-local activations (as a norm over local heads is): its gradient
    # differs per rank, and the hook sums it over the group
    torch.manual_seed(1 + c.get_rank())
    local = torch.randn(3, 4)
    model[2](local).square().sum().backward()
    reference[2](local).square().sum().backward()
    return {"classes": [type(m).__name__ for m in model], "tp": groups.get_tensor_model_parallel_world_size(),
            "shapes": [tuple(m.weight.shape) for m in model], "out": out.detach(), "ref": ref.detach(),
            "norm_grad": model[2].weight.grad, "ref_norm_grad": reference[2].weight.grad}


def test_on_two_ranks_the_mesh_and_the_layers_compute_the_unsplit_model():
    runs = run_function(_two_rank_job, nprocs=2, timeout=240)
    summed = runs[0]["ref_norm_grad"] + runs[1]["ref_norm_grad"]
    for r in runs:
        assert r["classes"] == ["LinearLayer", "LinearAllreduce", "LayerNorm"] and r["tp"] == 2
        assert r["shapes"] == [(5, 6), (4, 5), (4,)]
        torch.testing.assert_close(r["out"], r["ref"])
        # grad_allreduce: the replicated norm's gradient is summed over the tensor group
        torch.testing.assert_close(r["norm_grad"], summed)


class Conv1D(nn.Module):
    """Stands in for transformers' GPT-2 layer of that name: a 2-D weight stored [in, out]."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 6))


def test_a_matched_conv1d_is_refused_and_an_unmatched_one_left_whole():
    model = nn.Sequential()
    model.c_attn, model.c_proj = Conv1D(), Conv1D()
    config = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r"c_attn\.weight$"], "partition_type": "column"}]})
    autotp = _autotp(model, config)
    autotp.set_tensor_parallel_config(1, None)
    with pytest.raises(TensorParallelError, match=r"c_attn: GPT-2's Conv1D layers .* are not provided") as info:
        autotp._replace_module(model)
    assert "\n" not in str(info.value)
    config = AutoTPConfig.from_dict({"layer_specs": [{"patterns": [r"other\.weight$"], "partition_type": "column"}]})
    autotp = _autotp(model, config)
    autotp.set_tensor_parallel_config(1, None)
    autotp._replace_module(model)
    assert type(model.c_attn) is Conv1D and type(model.c_proj) is Conv1D
