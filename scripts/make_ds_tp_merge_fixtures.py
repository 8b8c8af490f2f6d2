"""Make tests/data/ds_tp_merge.json with real DeepSpeed (0.19.8, CPU): what its universal-checkpoint
converter and loader do with tensor-parallel pieces, case by case.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_tp_merge_fixtures.py

Recorded per case (inputs and DeepSpeed's answer in the same record, tensors as nested lists):
- merge: a slice folder (<param>/<tp>/<state>.<dp>) built from the case, merged by
  ds_to_universal.merge_tp_slices; each state's merged record (param, cat_dim, sub_param_shape,
  vocab_tensor), step.pt, the returned unmatched patterns, or the refusal (exception class and
  a phrase its message holds);
- zero_shards: ds_to_universal._merge_zero_shards on such a folder;
- group: ds_to_universal._group_per_tp_shapes; validate: _validate_autotp_conversion_support;
- resolve: universal_checkpoint._resolve_autotp_partition on a parameter carrying the given
  AutoTP metadata;
- load_hp: universal_checkpoint.load_hp_checkpoint_state on a parameter with a fragment mapping
  (the fp32 fragment it ends with, the optimizer fragments, the step).
Full tensors are arange values, so a recorded answer says which elements went where.
tests/runtime/train/checkpoint/test_tp_merge_ds.py replays our side.
"""
from __future__ import annotations

import json
import os
import tempfile
import types

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "ds_tp_merge.json")
V = "universal_checkpoint_version"
ROW, REP, SUB, WID = ("parameter_with_row_parallelism_patterns", "tp_replicated_parameter_patterns",
                      "parameter_with_sub_params", "sub_param_shard_widths")


def ar(*shape):
    n = 1
    for d in shape:
        n *= d
    return torch.arange(n, dtype=torch.float32).view(*shape)


def rows(t, ids):
    return t[ids].contiguous() if ids else t[:0].contiguous()


def sub(name, shape, dim=0):
    return [{"patterns": [f"^{name}$"], "shape": shape, "partition_dim": dim}]


def spec_tuples(uc):
    """The uc_info as DeepSpeed's callers hand it over: sub-parameter shape specs as tuples."""
    out = dict(uc)
    if SUB in out:
        out[SUB] = [dict(s, shape=tuple(tuple(d) if isinstance(d, list) else d for d in s["shape"]))
                    for s in out[SUB]]
    return out


Q = "module.qkv_proj.weight"
full12 = ar(12, 2)
# (id, param name, uc_info, {tp: [dp fragments]} of the fp32 state, per-tp shapes or None, extra)
MERGE = [
    ("subparam_sizes_legacy", "module.qkv.weight", {ROW: [], REP: [], SUB: sub("module.qkv.weight", [[2, 2, 2], 4])},
     {0: [ar(3, 4)], 1: [ar(3, 4) + 12]}, [[3, 4], [3, 4]], {}),
    ("current_version_without_widths", "module.qkv.weight",
     {V: 0.4, ROW: [], REP: [], SUB: sub("module.qkv.weight", [[2, 2, 2], 4])},
     {0: [ar(3, 4)], 1: [ar(3, 4)]}, [[3, 4], [3, 4]], {"phrase": "records no sub_param_shard_widths"}),
    ("legacy_count", "module.qkv.weight", {ROW: [], REP: [], SUB: sub("module.qkv.weight", [3, -1])},
     {0: [rows(full12, [0, 1, 4, 5, 8, 9])], 1: [rows(full12, [2, 3, 6, 7, 10, 11])]}, [[6, 2], [6, 2]], {}),
    ("legacy_uneven_sizes", "module.qkv.weight", {ROW: [], REP: [], SUB: sub("module.qkv.weight", [[6, 3, 3], 2])},
     {0: [rows(full12, [0, 1, 2, 6, 7, 9])], 1: [rows(full12, [3, 4, 5, 8, 10, 11])]}, [[6, 2], [6, 2]],
     {"phrase": "not divisible by tp_degree"}),
    ("uneven_widths", Q, {V: 0.4, ROW: [], REP: [], SUB: sub(Q, [[6, 3, 3], 2]), WID: {f"^{Q}$": [[4, 2], [2, 1], [2, 1]]}},
     {0: [rows(full12, [0, 1, 2, 3, 6, 7, 9, 10])], 1: [rows(full12, [4, 5, 8, 11])]}, [[8, 2], [4, 2]], {}),
    ("fused_bias", "module.qkv_proj.bias",
     {V: 0.4, ROW: [], REP: [], SUB: sub("module.qkv_proj.bias", [[6, 3, 3]]),
      WID: {"^module.qkv_proj.bias$": [[4, 2], [2, 1], [2, 1]]}},
     {0: [ar(12)[[0, 1, 2, 3, 6, 7, 9, 10]]], 1: [ar(12)[[4, 5, 8, 11]]]}, [[8], [4]], {}),
    ("rank_without_rows", Q, {V: 0.4, ROW: [], REP: [], SUB: sub(Q, [[2, 1, 1], -1]), WID: {f"^{Q}$": [[2, 0], [1, 0], [1, 0]]}},
     {0: [ar(4, 2)], 1: [ar(4, 2)[:0]]}, [[4, 2], [0, 2]], {}),
    ("rank_wrote_no_fragment", Q,
     {V: 0.4, ROW: [], REP: [], SUB: sub(Q, [[4, 2, 2], 2]), WID: {f"^{Q}$": [[2, 0, 2], [1, 0, 1], [1, 0, 1]]}},
     {0: [rows(ar(8, 2), [0, 1, 4, 6])], 2: [rows(ar(8, 2), [2, 3, 5, 7])]}, [[4, 2], [0, 2], [4, 2]], {"tp": 3}),
    ("row_parallel_uneven", "module.proj.weight", {ROW: ["^module.proj.weight$"], REP: [], SUB: []},
     {0: [ar(4, 3)], 1: [ar(4, 2) + 12]}, [[4, 3], [4, 2]], {}),
    ("column_two_dp_fragments", "fc.weight", {ROW: [], REP: [], SUB: []},
     {0: [ar(2, 4).flatten()[:5], ar(2, 4).flatten()[5:]], 1: [ar(2, 4).flatten()[:4] + 8, ar(2, 4).flatten()[4:] + 8]},
     [[2, 4], [2, 4]], {"steps": {0: [3, 3], 1: [3, 3]}}),
    ("column_no_shapes", "fc.weight", {ROW: [], REP: [], SUB: []},
     {0: [ar(2, 4)], 1: [ar(2, 4) + 8]}, None, {}),
    ("replicated", "ln.weight", {ROW: [], REP: ["^ln.weight$"], SUB: []},
     {0: [ar(4)], 1: [ar(4)]}, [[4], [4]], {"steps": {0: [torch.tensor(5.0)], 1: [torch.tensor(5.0)]}}),
    ("replicated_differ", "ln.weight", {ROW: [], REP: ["^ln.weight$"], SUB: []},
     {0: [ar(4)], 1: [ar(4) + 1]}, [[4], [4]], {"phrase": ""}),
    ("averaged", "ln.bias", {ROW: [], REP: [], SUB: [], "parameter_to_average_patterns": ["^ln.bias$"]},
     {0: [ar(4)], 1: [ar(4) + 2]}, [[4], [4]], {}),
    ("two_sub_params", "mlp.dense_h_to_4h.weight",
     {ROW: [], REP: [], SUB: [], "parameter_with_2_sub_params_cat_dim_0": [r"^mlp\.dense_h_to_4h\.weight$"]},
     {0: [ar(4, 2)], 1: [ar(4, 2) + 8]}, [[4, 2], [4, 2]], {}),
    ("vocabulary", "embed.weight",
     {ROW: [], REP: [], SUB: [], "vocabulary_parameter_patterns": ["^embed.weight$"], "original_vocab_size": 5},
     {0: [ar(3, 2)], 1: [ar(3, 2) + 6]}, [[3, 2], [3, 2]], {}),
    ("unmatched_patterns", "fc.weight", {ROW: ["^other.weight$"], REP: ["^ln.weight$"], SUB: sub("qkv.weight", [3, -1])},
     {0: [ar(2, 2)], 1: [ar(2, 2)]}, [[2, 2], [2, 2]], {}),
]

GROUP = [
    ("pp_local", [{"fc.weight": [3, 4], "layer0.weight": [2, 4]}, {"fc.weight": [2, 4], "layer0.weight": [2, 4]},
                  {"fc.weight": [3, 4], "layer1.weight": [2, 4]}, {"fc.weight": [2, 4], "layer1.weight": [2, 4]}], 2, 2,
     ""),
    ("replicas_disagree", [{"tied.weight": [3, 4]}, {"tied.weight": [2, 4]}, {"tied.weight": [1, 4]},
                           {"tied.weight": [2, 4]}], 2, 2, "disagree on shape"),
    ("tp_only", [{"a": [2, 2]}, {"a": [1, 2], "b": [3]}], 1, 2, ""),
]

VALIDATE = [
    ("legacy", {}, ""),
    ("unsupported", {"autotp_unsupported_parameter_patterns": {r"^qkv\.weight$": "CodeGenBlock layout is interleaved",
                                                               r"^b$": "other"}}, "CodeGenBlock layout is interleaved"),
]


def meta(**kw):
    base = {"sub_param_shape": None, "is_bias": False, "replicated": False}
    base.update(kw)
    return base


# (id, local shape, metadata, full tensor shape, tp rank, tp size, phrase of a refusal)
RESOLVE = [
    ("row_weight", [4, 4], meta(partition_type="row", partition_dim=1, logical_shape=[4, 8], original_shape=[4, 8]),
     [4, 8], 1, 2, ""),
    ("subparam_column", [3, 4], meta(partition_type="column", partition_dim=0, logical_shape=[6, 4],
                                     sub_param_shape=[[2, 2, 2], 4]), [6, 4], 0, 2, ""),
    ("gqa_sizes", [8, 2], meta(partition_type="column", partition_dim=0, logical_shape=[16, 2],
                               sub_param_shape=[[8, 4, 4], 2], sub_param_sizes=[8, 4, 4]), [16, 2], 1, 2, ""),
    ("partition_sizes", [50, 4], meta(partition_dim=0, logical_shape=[101, 4], partition_sizes=[51, 50]),
     [101, 4], 1, 2, ""),
    ("partition_sizes_bias", [50], meta(partition_dim=0, logical_shape=[101], partition_sizes=[51, 50], is_bias=True),
     [101], 1, 2, ""),
    ("sizes_over_count", [6, 8], meta(partition_dim=0, logical_shape=[12, 8], sub_param_shape=[3, -1],
                                      sub_param_sizes=[4, 4, 4]), [12, 8], 0, 2, ""),
    ("uneven_sizes_no_widths", [5, 2], meta(partition_dim=0, logical_shape=[16, 2], sub_param_sizes=[8, 4, 4],
                                            sub_param_shard_widths=None), [16, 2], 0, 3, "not divisible by tp_world_size"),
    ("uneven_no_partition_sizes", [3, 2], meta(partition_dim=0, logical_shape=[10, 2]), [10, 2], 3, 4,
     "records no partition_sizes"),
    ("replicated_bias", [8], meta(partition_dim=None, logical_shape=[8], is_bias=True, replicated=True), [8], 1, 2, ""),
    ("widths_v04", [6, 2], meta(partition_dim=0, logical_shape=[12, 2], sub_param_sizes=[6, 3, 3],
                                sub_param_shard_widths=[[2, 2, 2], [1, 1, 1], [1, 1, 1]], **{V: 0.4}),
     [12, 2], 2, 3, ""),
    ("subparam_record", [6, 2], meta(partition_dim=0, logical_shape=[12, 2], sub_param_shape="record"), [12, 2], 1, 2,
     ""),
    ("no_meta", [2, 2], None, [4, 2], 0, 2, ""),
    ("unsupported_reason", [2, 2], meta(partition_dim=0, logical_shape=[4, 2],
                                        conversion={"unsupported_reason": "interleaved layout"}), [4, 2], 0, 2,
     "interleaved layout"),
]

# (id, local shape, metadata or None, {state: saved record}, tp rank, tp size, fragment (start, numel) or None)
LOAD_HP = [
    ("meta_row", [4, 4], RESOLVE[0][2], {"fp32": {"param": [4, 8]}}, 1, 2, None),
    ("mqa_single_kv_head", [3, 4], meta(partition_dim=0, logical_shape=[3, 4], sub_param_sizes=[1, 1, 1],
                                        sub_param_shard_widths=[[1, 0], [1, 0], [1, 0]], **{V: 0.4}),
     {"fp32": {"param": [3, 4]}}, 0, 2, None),
    ("legacy_cat0_with_states", [2, 4], None,
     {"fp32": {"param": [4, 4], "cat_dim": 0}, "exp_avg": {"param": [4, 4], "cat_dim": 0, "scale": 10},
      "step": 7}, 1, 2, None),
    ("legacy_cat1_fragment", [4, 2], None, {"fp32": {"param": [4, 4], "cat_dim": 1},
                                            "exp_avg_sq": {"param": [4, 4], "cat_dim": 1, "scale": 100}}, 1, 2, [2, 4]),
    ("legacy_two_sub", [4, 2], None, {"fp32": {"param": [8, 2], "cat_dim": 0, "param_n_sub_params": 2}}, 1, 2, None),
    ("legacy_sub_shape", [4, 2], None, {"fp32": {"param": [12, 2], "sub_param_shape": [[6, 3, 3], 2]}}, 0, 3, None),
    ("legacy_same_shape", [4], None, {"fp32": {"param": [4]}}, 1, 2, None),
    ("vocab_padding", [3, 2], None, {"fp32": {"param": [5, 2], "vocab_tensor": True}}, 1, 2, None),
]


def to_list(v):
    return v.tolist() if torch.is_tensor(v) else v


def sub_record(s):
    return {"patterns": list(s.patterns), "shape": json.loads(json.dumps(s.shape)), "partition_dim": s.partition_dim}


def refusal(exc, phrase):
    assert phrase in str(exc), (phrase, str(exc))
    return {"error": type(exc).__name__, "phrase": phrase, "message": str(exc)}


def run_merge(D, case):
    cid, name, uc, fp32, shapes, extra = case
    tp = extra.get("tp", 2)
    with tempfile.TemporaryDirectory() as tmp:
        sdir, odir = os.path.join(tmp, "slices"), os.path.join(tmp, "out")
        for t, frags in fp32.items():
            folder = os.path.join(sdir, name, str(t))
            os.makedirs(folder, exist_ok=True)
            for dp, f in enumerate(frags):
                for state, k in (("fp32", 1), ("exp_avg", 10), ("exp_avg_sq", 100)):
                    torch.save((f * k).reshape(-1).clone(), os.path.join(folder, f"{state}.{dp:02d}"))
            for dp, s in enumerate((extra.get("steps") or {}).get(t, [])):
                torch.save(s, os.path.join(folder, f"step.{dp:02d}"))
        rec = {"id": cid, "name": name, "uc_info": uc, "tp": tp, "shapes": shapes,
               "fragments": {str(t): [f.tolist() for f in frags] for t, frags in fp32.items()},
               "steps": {str(t): [to_list(s) for s in v] for t, v in (extra.get("steps") or {}).items()},
               "step_is_tensor": any(torch.is_tensor(s) for v in (extra.get("steps") or {}).values() for s in v)}
        try:
            unmatched = D.merge_tp_slices(spec_tuples(uc), odir, sdir, tp,
                                          (name, None if shapes is None else [torch.Size(s) for s in shapes]))
        except Exception as exc:  # noqa: BLE001  DeepSpeed's refusal is the answer recorded
            rec.update(refusal(exc, extra.get("phrase", "")))
            return rec
        assert "phrase" not in extra, cid
        rec["unmatched"] = sorted(unmatched)
        out = {}
        for f in sorted(os.listdir(os.path.join(odir, name))):
            v = torch.load(os.path.join(odir, name, f), weights_only=False)
            if f == "step.pt":
                out["step"] = to_list(v)
                continue
            out[f[:-3]] = {k: (sub_record(x) if k == "sub_param_shape" else to_list(x)) for k, x in v.items()}
        rec["merged"] = out
        return rec


class Addr:
    def __init__(self, start, numel):
        self.start, self.numel = start, numel


class Mapping:
    def __init__(self, param, frag):
        start, numel = frag or (0, param.numel())
        self.lp_fragment_address = Addr(start, numel)
        self.hp = torch.zeros(numel)
        self.optim_fragment = {}

    def get_hp_fragment(self):
        return self.hp


def main():
    import deepspeed
    import deepspeed.checkpoint.ds_to_universal as D
    import deepspeed.checkpoint.universal_checkpoint as U

    out = {"deepspeed": deepspeed.__version__, "merge": [], "zero_shards": [], "group": [], "validate": [],
           "resolve": [], "load_hp": []}
    for case in MERGE:
        out["merge"].append(run_merge(D, case))
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "p", "0"))
        torch.save(torch.zeros(8), os.path.join(tmp, "p", "0", "fp32.00"))
        try:
            D._merge_zero_shards(os.path.join(tmp, "p"), "fp32", 2, [torch.Size([4, 2]), torch.Size([4, 2])])
            raise SystemExit("DeepSpeed merged a missing rank that owns elements")
        except AssertionError as exc:
            out["zero_shards"].append(dict(id="missing_rank_not_empty", tp=2, written={"0": 8}, shapes=[[4, 2], [4, 2]],
                                           **refusal(exc, "not empty")))
    for cid, shapes, pp, tp, phrase in GROUP:
        rec = {"id": cid, "files": shapes, "pp": pp, "tp": tp}
        try:
            got = D._group_per_tp_shapes([{k: tuple(v) for k, v in d.items()} for d in shapes], pp, tp)
            rec["grouped"] = {k: [None if s is None else list(s) for s in v] for k, v in sorted(got.items())}
        except Exception as exc:  # noqa: BLE001
            rec.update(refusal(exc, phrase))
        out["group"].append(rec)
    for cid, info, phrase in VALIDATE:
        rec = {"id": cid, "info": info}
        try:
            D._validate_autotp_conversion_support(info)
        except Exception as exc:  # noqa: BLE001
            rec.update(refusal(exc, phrase))
        out["validate"].append(rec)
    for cid, local, m, full_shape, rank, size, phrase in RESOLVE:
        p = torch.nn.Parameter(torch.zeros(local))
        if m is not None:
            m = dict(m)
            if m.get("sub_param_shape") == "record":
                m["sub_param_shape"] = U.SubparamShape(patterns=["x"], shape=((6, 3, 3), 2), partition_dim=0)
            elif m.get("sub_param_shape") is not None:
                m["sub_param_shape"] = tuple(tuple(d) if isinstance(d, list) else d for d in m["sub_param_shape"])
            p.ds_autotp_universal_checkpoint_meta = m
        full = ar(*full_shape)
        rec = {"id": cid, "local": local, "meta": RESOLVE_META_JSON(m), "full": full_shape, "rank": rank, "size": size}
        try:
            got = U._resolve_autotp_partition(p, {"param": full}, full, rank, size)
            rec["piece"] = None if got is None else got.tolist()
        except Exception as exc:  # noqa: BLE001
            rec.update(refusal(exc, phrase))
        out["resolve"].append(rec)
    for cid, local, m, saved, rank, size, frag in LOAD_HP:
        p = torch.nn.Parameter(torch.zeros(local))
        if m is not None:
            p.ds_autotp_universal_checkpoint_meta = dict(m)
        p._hp_mapping = Mapping(p, frag)
        with tempfile.TemporaryDirectory() as tmp:
            for state, r in saved.items():
                if state == "step":
                    torch.save(r, os.path.join(tmp, "step.pt"))
                    continue
                rec_ = {"param": ar(*r["param"]) * r.get("scale", 1)}
                for k in ("cat_dim", "param_n_sub_params", "vocab_tensor"):
                    if k in r:
                        rec_[k] = r[k]
                if "sub_param_shape" in r:
                    rec_["sub_param_shape"] = U.SubparamShape(
                        patterns=["x"], shape=tuple(tuple(d) if isinstance(d, list) else d for d in r["sub_param_shape"]),
                        partition_dim=0)
                torch.save(rec_, os.path.join(tmp, f"{state}.pt"))
            step = U.load_hp_checkpoint_state(p, tmp, rank, size)
        out["load_hp"].append({"id": cid, "local": local, "meta": m, "saved": saved, "rank": rank, "size": size,
                               "fragment": frag, "step": to_list(step), "hp": p._hp_mapping.hp.tolist(),
                               "optim": {k: v.tolist() for k, v in sorted(p._hp_mapping.optim_fragment.items())}})
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {OUT}: " + ", ".join(f"{len(v)} {k}" for k, v in out.items() if isinstance(v, list)))


def RESOLVE_META_JSON(m):  # noqa: N802  the metadata as JSON (a SubparamShape record by its fields)
    if m is None:
        return None
    out = dict(m)
    s = out.get("sub_param_shape")
    if s is not None and hasattr(s, "partition_dim"):
        out["sub_param_shape"] = {"record": sub_record(s)}
    return json.loads(json.dumps(out))


if __name__ == "__main__":
    main()
