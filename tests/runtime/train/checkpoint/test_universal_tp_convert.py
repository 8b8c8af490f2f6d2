"""ds_to_universal on a tensor-parallel checkpoint (DeepSpeed 0.19.8's main(args)): a tiny
Llama trained at tp 2 under ZeRO-2 and saved by our engine, converted, then loaded universal
at tp 1 on one rank and on two data ranks, and at tp 2 again. The loaded weights must be the saving run's full
weights, and one more step from the universal folder must match one more step from the
tensor-parallel checkpoint itself (resumed at tp 1 by re-cutting its slices, an independent
path), which holds only if the Adam moments and step came through whole."""
import os
from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_function
from hf_fixture import tiny_llama
from lm_steps import train_lm_steps

SEQ, VOCAB, MICRO = 8, 64, 2


def _tokens(step):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def body(tp, stage, steps=0, load=None, tag=None, universal=False, save=None):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import comm
    from dslaunch.runtime.tensor_parallel import full_state_dict

    torch.manual_seed(1)
    net = tiny_llama(VOCAB, kv_heads=4, attn="eager")
    dp = comm.get_world_size() // tp
    cfg = {"train_micro_batch_size_per_gpu": MICRO // dp, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    def whole():
        full = full_state_dict(engine.module) if tp > 1 else dict(engine.module.state_dict())
        return {k: v.detach().float().clone() for k, v in full.items()}

    loaded = None
    if load:
        engine.load_checkpoint(load, tag=tag)
        loaded = whole()
    first = engine.global_steps
    losses = train_lm_steps(engine, _tokens, range(first, first + steps), MICRO // dp)
    if save:
        engine.save_checkpoint(save, tag="t")
    full = whole()
    return (losses, loaded, full) if engine.global_rank == 0 else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpuc")
    out = run_function(body, nprocs=2, kwargs=dict(tp=2, stage=2, steps=2, save=str(root)), timeout=300)[0]
    return root, out[2]


def _convert(src, dst, **extra):
    from dslaunch.runtime.checkpoint.ds_to_universal import main

    args = SimpleNamespace(input_folder=src, output_folder=dst, num_extract_workers=1, num_merge_workers=2,
                           keep_temp_folder=False, strict=True, inject_missing_state=False)
    for k, v in extra.items():
        setattr(args, k, v)
    main(args)


def test_tp2_checkpoint_converts_and_loads_universal_at_tp1_on_one_and_two_ranks_and_at_tp2(saved):
    root, trained = saved
    _convert(str(root / "t"), str(root / "t_universal"))
    zero = root / "t_universal" / "zero"
    assert (root / "latest_universal").read_text() == "t_universal"
    assert not (root / "t_universal" / "tmp").exists()
    # the merged files hold the full parameters, whichever way each was split
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.norm.weight"):
        rec = torch.load(zero / name / "fp32.pt", weights_only=False)
        torch.testing.assert_close(rec["param"], trained[name], rtol=0, atol=0)
        assert torch.load(zero / name / "exp_avg.pt", weights_only=False)["param"].shape == trained[name].shape

    direct = run_function(body, nprocs=1, kwargs=dict(tp=1, stage=0, steps=1, load=str(root), tag="t"),
                          timeout=300)[0]
    one = run_function(body, nprocs=1, kwargs=dict(tp=1, stage=1, steps=1, load=str(root), tag="t_universal",
                                                   universal=True), timeout=300)[0]
    two = run_function(body, nprocs=2, kwargs=dict(tp=1, stage=2, steps=1, load=str(root), tag="t_universal",
                                                   universal=True), timeout=300)[0]
    # back at tp 2 (ZeRO-1): each rank cuts its slices from the whole tensors by its layers' splits
    tp2 = run_function(body, nprocs=2, kwargs=dict(tp=2, stage=1, steps=1, load=str(root), tag="t_universal",
                                                   universal=True), timeout=300)[0]
    for got, tol in ((one, 1e-5), (two, 1e-5), (tp2, 1e-4)):
        for name, value in trained.items():
            torch.testing.assert_close(got[1][name], value, rtol=0, atol=0, msg=name)
        # the step after the load: same loss and weights as resuming the tp-2 checkpoint itself
        assert got[0] == pytest.approx(direct[0], rel=tol)
        for name, value in direct[2].items():
            torch.testing.assert_close(got[2][name], value, rtol=tol, atol=tol / 10, msg=name)


def test_patterns_matching_nothing_and_unsupported_layouts_are_one_line(saved, tmp_path):
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.checkpoint.constants import (AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
                                                       TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO)
    from dslaunch.runtime.checkpoint.tp_merge import uc_info_from_shard_specs
    from dslaunch.runtime.checkpoint.universal import convert

    root, _ = saved
    src = tmp_path / "t"
    src.mkdir()
    for f in os.listdir(root / "t"):
        if f != "manifest.json":  # read as DeepSpeed's: the patterns come from the model states
            (src / f).write_bytes((root / "t" / f).read_bytes())
    model = torch.load(src / "mp_rank_00_model_states.pt", weights_only=False)
    shapes = {n: list(s) for g in model["param_shapes"] for n, s in g.items()}
    info = uc_info_from_shard_specs(model["dslaunch"]["tensor_parallel_shards"], shapes, 2)
    model.pop("dslaunch")
    for i in range(2):
        m = torch.load(src / f"mp_rank_0{i}_model_states.pt", weights_only=False)
        m.pop("dslaunch")
        m[UNIVERSAL_CHECKPOINT_INFO] = dict(info, **{TP_REPLICATED_PARAMETER_PATTERNS:
                                                     info[TP_REPLICATED_PARAMETER_PATTERNS] + [r"^nothing$"]})
        torch.save(m, src / f"mp_rank_0{i}_model_states.pt")
    with pytest.raises(CheckpointError, match=r"patterns \['\^nothing\$'\] match no parameter"):
        convert(str(src), str(tmp_path / "u"))
    done = convert(str(src), str(tmp_path / "u"), strict=False)  # --no_strict
    assert done.params == len(shapes)
    for i in range(2):
        m = torch.load(src / f"mp_rank_0{i}_model_states.pt", weights_only=False)
        m[UNIVERSAL_CHECKPOINT_INFO][AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS] = {"^x$": "interleaved heads"}
        torch.save(m, src / f"mp_rank_0{i}_model_states.pt")
    with pytest.raises(CheckpointError, match="AutoTP universal checkpoint conversion is not supported for "
                                              r"\^x\$: interleaved heads"):
        convert(str(src), str(tmp_path / "u2"))
    with pytest.raises(CheckpointError, match="interleaved heads"):  # injecting missing state does not skip it
        convert(str(src), str(tmp_path / "u2"), inject_missing_state=True)
    for i in range(2):
        m = torch.load(src / f"mp_rank_0{i}_model_states.pt", weights_only=False)
        m.pop(UNIVERSAL_CHECKPOINT_INFO)
        torch.save(m, src / f"mp_rank_0{i}_model_states.pt")
    with pytest.raises(CheckpointError, match="records no universal_checkpoint_info"):
        convert(str(src), str(tmp_path / "u3"))


def test_uc_info_from_shard_specs_maps_each_split():
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.checkpoint.tp_merge import uc_info_from_shard_specs, vocab_rows

    specs = {"row.weight": {"dim": 1, "full": 8, "parts": [], "vocab": False, "conv1d": False},
             "col.weight": {"dim": 0, "full": 5, "parts": [], "vocab": False, "conv1d": False},
             "qkv.weight": {"dim": 0, "full": 12, "parts": [4, 4, 4], "vocab": False, "conv1d": False},
             "embed.weight": {"dim": 0, "full": 7, "parts": [], "vocab": True, "conv1d": False}}
    shapes = {"row.weight": [3, 4], "col.weight": [3, 8], "qkv.weight": [6, 8], "embed.weight": [4, 8],
              "norm.weight": [8]}
    info = uc_info_from_shard_specs(specs, shapes, 2)
    assert info["parameter_with_row_parallelism_patterns"] == [r"^row\.weight$"]
    assert info["tp_replicated_parameter_patterns"] == [r"^norm\.weight$"]
    # a vocabulary split joins along dim 0: the converter leaves its padding rows out of the slices
    assert info["vocabulary_parameter_patterns"] == [] and "original_vocab_size" not in info
    assert vocab_rows(specs["embed.weight"], 2, 0) == 4 and vocab_rows(specs["embed.weight"], 2, 1) == 3
    assert vocab_rows(specs["col.weight"], 2, 1) is None
    assert info["parameter_with_sub_params"] == [{"patterns": [r"^qkv\.weight$"], "shape": [(4, 4, 4), 8],
                                                  "partition_dim": 0}]
    assert info["sub_param_shard_widths"] == {r"^qkv\.weight$": [[2, 2], [2, 2], [2, 2]]}
    specs["c.weight"] = {"dim": 0, "full": 4, "parts": [], "vocab": False, "conv1d": True}
    with pytest.raises(CheckpointError, match="HF Conv1D weight split by tensor parallelism"):
        uc_info_from_shard_specs(specs, dict(shapes, **{"c.weight": [8, 2]}), 2)


def _ds_fixture():
    import json

    from repo_paths import DATA

    root = os.path.join(DATA, "ds_tp_universal")
    with open(os.path.join(root, "expected.json")) as fh:
        return os.path.join(root, "ckpt", "t"), json.load(fh)


def test_deepspeeds_tp2_checkpoint_converts_as_deepspeeds_converter_did(tmp_path):
    """A checkpoint real DeepSpeed saved at autotp_size 2 under ZeRO-1 (q/k/v column, o row,
    lm_head of 11 rows split 6/5, a replicated norm; scripts/make_ds_tp_universal_fixtures.py):
    our main(args) writes the tensors DeepSpeed's converter wrote. DeepSpeed joined them by its
    affine map, ours by the patterns it keeps beside the map, so only the tensors and steps
    are compared (DeepSpeed's map branch writes no cat_dim)."""
    src, expected = _ds_fixture()
    _convert(src, str(tmp_path / "u"))
    zero = tmp_path / "u" / "zero"
    assert sorted(p.name for p in zero.iterdir() if p.is_dir()) == sorted(expected["universal"])
    for name, rec in expected["universal"].items():
        for state, value in rec.items():
            got = torch.load(zero / name / f"{state}.pt", weights_only=False)
            if state == "step":
                assert float(got) == value, name
            else:
                torch.testing.assert_close(got["param"], torch.tensor(value["param"]), rtol=0, atol=0,
                                           msg=f"{name} {state}")
    # and it loads universal at tp 1: the weights are each tensor rank's, joined
    out = run_function(ds_body, nprocs=1, kwargs=dict(root=str(tmp_path), tag="u"), timeout=300)[0]
    for name, per_rank in expected["local"].items():
        pieces = [torch.tensor(t) for t in per_rank]
        full = (pieces[0] if name in ("norm.weight", "norm.bias", "self_attn.o_proj.bias") else
                torch.cat(pieces, dim=1 if name == "self_attn.o_proj.weight" else 0))
        torch.testing.assert_close(out[name], full, rtol=0, atol=0, msg=name)


def ds_body(root, tag):
    import sys

    import dslaunch.runtime as deepspeed
    from repo_paths import SCRIPTS

    sys.path.insert(0, str(SCRIPTS))
    from make_ds_tp_universal_fixtures import Net

    net = Net()
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 1}, "checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    engine.load_checkpoint(root, tag=tag)
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
