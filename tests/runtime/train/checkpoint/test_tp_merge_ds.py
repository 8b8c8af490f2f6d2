"""Tensor-parallel universal-checkpoint merging and per-parameter restoring
(train/checkpoint/tp_merge.py, autotp_restore.py) against DeepSpeed 0.19.8, as recorded in
tests/data/ds_tp_merge.json (scripts/make_ds_tp_merge_fixtures.py): each case's slice folder is
rebuilt from the record, merged by ours, and every merged file (param, cat_dim,
sub_param_shape, vocab_tensor), step.pt and the unmatched patterns must equal DeepSpeed's; a
case DeepSpeed refuses must be refused by the same exception class (one CheckpointError line
that is also DeepSpeed's AssertionError/ValueError) naming the same problem. The same for the
pipeline-shape grouping, the unsupported-layout check, the per-rank cut from AutoTP metadata
and load_hp_checkpoint_state over a fragment mapping."""
import builtins
import json
import os

import pytest
import torch

import dslaunch.runtime  # noqa: F401  installs the alias table
from dslaunch.runtime.core.errors import CheckpointError
from dslaunch.runtime.train.checkpoint import autotp_restore, tp_merge
from dslaunch.runtime.train.checkpoint.files import load_torch
from dslaunch.runtime.train.checkpoint.foreign import SubparamShape
from repo_paths import DATA

DS = json.loads((DATA / "ds_tp_merge.json").read_text())
SUB = "parameter_with_sub_params"


def ids(kind):
    return [r["id"] for r in DS[kind]]


def record(kind, cid):
    return next(r for r in DS[kind] if r["id"] == cid)


def tuples(spec):
    return tuple(tuple(d) if isinstance(d, list) else d for d in spec)


def as_info(uc):
    """The info as DeepSpeed's callers hand it over (the fixture script does the same)."""
    out = dict(uc)
    if SUB in out:
        out[SUB] = [dict(s, shape=tuples(s["shape"])) for s in out[SUB]]
    return out


def assert_refused(rec, call):
    with pytest.raises(CheckpointError) as err:
        call()
    assert isinstance(err.value, getattr(builtins, rec["error"])), (type(err.value).__mro__, rec["error"])
    assert rec["phrase"] in str(err.value)
    assert "\n" not in str(err.value)


def plain(value):
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, SubparamShape):
        return {"patterns": list(value.patterns), "shape": json.loads(json.dumps(value.shape)),
                "partition_dim": value.partition_dim}
    return value


@pytest.mark.parametrize("cid", ids("merge"))
def test_merge_tp_slices_matches_deepspeed(tmp_path, cid):
    rec = record("merge", cid)
    name = rec["name"]
    for tp, frags in rec["fragments"].items():
        folder = tmp_path / "slices" / name / tp
        folder.mkdir(parents=True)
        for dp, values in enumerate(frags):
            t = torch.tensor(values, dtype=torch.float32).reshape(-1)
            for state, k in (("fp32", 1), ("exp_avg", 10), ("exp_avg_sq", 100)):
                torch.save((t * k).clone(), folder / f"{state}.{dp:02d}")
        for dp, s in enumerate(rec["steps"].get(tp, [])):
            torch.save(torch.tensor(s) if rec["step_is_tensor"] else s, folder / f"step.{dp:02d}")
    shapes = None if rec["shapes"] is None else [torch.Size(s) for s in rec["shapes"]]

    def merge():
        return tp_merge.merge_tp_slices(as_info(rec["uc_info"]), str(tmp_path / "out"), str(tmp_path / "slices"),
                                        rec["tp"], (name, shapes))

    if "error" in rec:
        assert_refused(rec, merge)
        return
    assert sorted(merge()) == rec["unmatched"]
    got = {}
    for f in sorted(os.listdir(tmp_path / "out" / name)):
        value = load_torch(str(tmp_path / "out" / name / f))  # weights_only: our files load without trust
        got["step" if f == "step.pt" else f[:-3]] = (plain(value) if f == "step.pt"
                                                     else {k: plain(v) for k, v in value.items()})
    assert got == rec["merged"]


def test_merge_zero_shards_refuses_a_missing_rank_that_owns_elements(tmp_path):
    rec = record("zero_shards", "missing_rank_not_empty")
    for tp, numel in rec["written"].items():
        (tmp_path / "p" / tp).mkdir(parents=True)
        torch.save(torch.zeros(numel), tmp_path / "p" / tp / "fp32.00")
    assert_refused(rec, lambda: tp_merge.merge_zero_shards(str(tmp_path / "p"), "fp32", rec["tp"],
                                                           [torch.Size(s) for s in rec["shapes"]]))


def test_merge_zero_shards_refuses_an_unparsable_dp_rank(tmp_path):
    (tmp_path / "p" / "0").mkdir(parents=True)
    torch.save(torch.zeros(2), tmp_path / "p" / "0" / "fp32.x1")
    with pytest.raises(CheckpointError, match="cannot parse the dp rank"):
        tp_merge.merge_zero_shards(str(tmp_path / "p"), "fp32", 1)


@pytest.mark.parametrize("cid", ids("group"))
def test_group_per_tp_shapes_matches_deepspeed(cid):
    rec = record("group", cid)
    files = [{k: tuple(v) for k, v in d.items()} for d in rec["files"]]

    def group():
        return tp_merge.group_per_tp_shapes(files, rec["pp"], rec["tp"])

    if "error" in rec:
        assert_refused(rec, group)
        return
    got = {k: [None if s is None else list(s) for s in v] for k, v in group().items()}
    assert got == rec["grouped"]


@pytest.mark.parametrize("cid", ids("validate"))
def test_validate_autotp_conversion_support_matches_deepspeed(cid):
    rec = record("validate", cid)
    if "error" in rec:
        assert_refused(rec, lambda: tp_merge.validate_autotp_conversion_support(rec["info"]))
        with pytest.raises(ValueError) as err:
            tp_merge.validate_autotp_conversion_support(rec["info"])
        assert str(err.value) == rec["message"].rstrip(".")  # every pattern and reason, in DeepSpeed's order
    else:
        tp_merge.validate_autotp_conversion_support(rec["info"])


def _param(local, meta):
    p = torch.nn.Parameter(torch.zeros(local))
    if meta is not None:
        meta = dict(meta)
        s = meta.get("sub_param_shape")
        if isinstance(s, dict):
            meta["sub_param_shape"] = SubparamShape(s["record"]["patterns"], tuples(s["record"]["shape"]),
                                                    s["record"]["partition_dim"])
        elif s is not None:
            meta["sub_param_shape"] = tuples(s)
        setattr(p, "ds_autotp_universal_checkpoint_meta", meta)
    return p


def _arange(shape):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)


@pytest.mark.parametrize("cid", ids("resolve"))
def test_resolve_autotp_partition_matches_deepspeed(cid):
    rec = record("resolve", cid)
    p = _param(rec["local"], rec["meta"])
    full = _arange(rec["full"])

    def resolve():
        return autotp_restore.resolve_autotp_partition(p, {"param": full}, full, rec["rank"], rec["size"])

    if "error" in rec:
        assert_refused(rec, resolve)
        return
    got = resolve()
    assert (None if got is None else got.tolist()) == rec["piece"]


class _Address:
    def __init__(self, start, numel):
        self.start, self.numel = start, numel


class _Mapping:
    """DeepSpeed's hp-fragment mapping as its optimizers hang it on a parameter."""

    def __init__(self, param, fragment):
        start, numel = fragment or (0, param.numel())
        self.lp_fragment_address = _Address(start, numel)
        self.hp = torch.zeros(numel)
        self.optim_fragment = {"stale": torch.zeros(1)}

    def get_hp_fragment(self):
        return self.hp


@pytest.mark.parametrize("cid", ids("load_hp"))
def test_load_hp_checkpoint_state_matches_deepspeed(tmp_path, cid):
    rec = record("load_hp", cid)
    p = _param(rec["local"], rec["meta"])
    p._hp_mapping = _Mapping(p, rec["fragment"])
    for state, saved in rec["saved"].items():
        if state == "step":
            torch.save(saved, tmp_path / "step.pt")
            continue
        obj = {"param": _arange(saved["param"]) * saved.get("scale", 1)}
        obj.update({k: saved[k] for k in ("cat_dim", "param_n_sub_params", "vocab_tensor") if k in saved})
        if "sub_param_shape" in saved:
            obj["sub_param_shape"] = SubparamShape(["x"], tuples(saved["sub_param_shape"]), 0)
        if "sub_param_shape" in obj:  # a DeepSpeed-pickled record: write it under DeepSpeed's class name
            from dslaunch.runtime.train.checkpoint.files import write_torch
            write_torch(str(tmp_path / f"{state}.pt"), obj, deepspeed_objects=True, checksum=False)
        else:
            torch.save(obj, tmp_path / f"{state}.pt")
    step = autotp_restore.load_hp_checkpoint_state(p, str(tmp_path), rec["rank"], rec["size"])
    assert step == rec["step"]
    assert p._hp_mapping.hp.tolist() == rec["hp"]
    assert {k: v.tolist() for k, v in p._hp_mapping.optim_fragment.items()} == rec["optim"]


def test_load_hp_checkpoint_state_refuses_a_parameter_without_a_fragment_mapping(tmp_path):
    with pytest.raises(CheckpointError, match="no DeepSpeed hp-fragment mapping"):
        autotp_restore.load_hp_checkpoint_state(torch.nn.Parameter(torch.zeros(2)), str(tmp_path), 0, 1)


def test_get_param_uc_restore_meta_is_the_layer_written_record():
    meta = {"partition_dim": 1, "conversion": {"partition_dim": 999}}
    p = _param([2], meta)
    assert autotp_restore.get_param_uc_restore_meta(p) == meta
    assert autotp_restore.get_param_uc_restore_meta(torch.zeros(1)) is None


def test_subparam_shape_pickles_under_deepspeeds_class_name(tmp_path):
    from dslaunch.runtime.train.checkpoint.files import write_torch
    write_torch(str(tmp_path / "f.pt"), {"s": SubparamShape(["a"], ((2, 2), 4), 0)}, deepspeed_objects=True,
                checksum=False)
    assert b"deepspeed.checkpoint.universal_checkpoint" in (tmp_path / "f.pt").read_bytes()
    back = load_torch(str(tmp_path / "f.pt"))["s"]
    assert (back.patterns, back.shape, back.partition_dim) == (["a"], ((2, 2), 4), 0)
