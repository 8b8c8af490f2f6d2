"""DeepSpeed's Muon (`"optimizer": {"type": "Muon"}`) against DeepSpeed 0.19.8's own runs.

The losses of every case (ZeRO 0-3, 2 and 3 ranks, offload, accumulation, both Newton-Schulz
methods, bf16) equal the ones DeepSpeed recorded for the same script
(scripts/make_ds_muon_fixtures.py; DeepSpeed is not needed here). Checkpoints carry the
momentum and resume at another world size and stage with DeepSpeed's uninterrupted losses.
The pieces are held to their definitions: DeepSpeed's tagging rule and group settings, the
batched Newton-Schulz against one matrix at a time, the gram iteration against the
standard one, and the optimizer state against its formula.
"""
import json
import os

import pytest
import torch

from dist_harness import run_function
import repo_paths
from script_modules import load_script

ROOT = str(repo_paths.ROOT)
DATA = os.path.join(ROOT, "tests", "data", "ds_muon")
fx = load_script("make_ds_muon_fixtures")

with open(os.path.join(DATA, "expected.json")) as _fh:
    EXPECTED = json.load(_fh)
# fp32: the same maths in the same order up to matmul blocking (DeepSpeed compiles its update
# with torch.compile); bf16: the forward and the module weights round to bf16, and DeepSpeed's
# stage 2 keeps bf16 gradients and momentum where dslaunch accumulates in fp32
TOL = {"fp32": 1e-5, "bf16": 2e-2}
STANDARD_TOL = 1e-4  # "standard" Newton-Schulz runs in bf16 on a CPU: bf16 matmuls round apart (1e-5 seen)


# -- pieces ----------------------------------------------------------------------------------------
def test_tagging_follows_deepspeed_rule():
    from dslaunch.runtime.core.muon.tagging import tag_parameters

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_Embedding = torch.nn.Embedding(5, 4)
            self.norm = torch.nn.LayerNorm(4)
            self.fc = torch.nn.Linear(4, 4)
            self.conv = torch.nn.Conv2d(2, 3, 3)
            self.LM_HEAD = torch.nn.Linear(4, 5)
            self.stack = torch.nn.Parameter(torch.zeros(2, 3, 4))

    m = M()
    m.fc.weight.use_muon = False  # initialize's tags overwrite what was there, as DeepSpeed's
    tag_parameters(m)
    tags = {n: p.use_muon for n, p in m.named_parameters()}
    assert tags == {"tok_Embedding.weight": False, "norm.weight": False, "norm.bias": False, "fc.weight": True,
                    "fc.bias": False, "conv.weight": True, "conv.bias": False, "LM_HEAD.weight": False,
                    "LM_HEAD.bias": False, "stack": True}


def test_group_settings_resolve_most_specific_last():
    from dslaunch.runtime.core.muon.tagging import split_groups
    from dslaunch.runtime.strict import ConfigError

    w, b, w2 = (torch.nn.Parameter(torch.zeros(s)) for s in ((3, 3), (3,), (2, 2)))
    w.use_muon, b.use_muon, w2.use_muon = True, False, True
    groups = split_groups([{"params": [w, b], "weight_decay": 0.0, "name": "decay_free"}, {"params": [w2]}],
                          {"lr": 1.0, "muon_lr": 0.5, "weight_decay": 0.1, "betas": (0.8, 0.9), "momentum": 0.7})
    assert [(g["name"], g["use_muon"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("decay_free-muon-params", True, 0.5, 0.0), ("decay_free-adam-params", False, 1.0, 0.0),
        ("group1-muon-params", True, 0.5, 0.1)]
    assert groups[0]["momentum"] == 0.7 and "betas" not in groups[0] and groups[1]["betas"] == (0.8, 0.9)
    stray = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ConfigError, match="1 are not"):
        split_groups([w, stray], {})


def test_defaults_are_deepspeeds():
    from dslaunch.runtime.core.muon.optimizer import MuonWithAuxAdam

    w, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    opt = MuonWithAuxAdam([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    assert {k: opt.param_groups[0][k] for k in ("lr", "momentum", "weight_decay", "ns_method")} == \
        {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
    assert {k: opt.param_groups[1][k] for k in ("lr", "betas", "eps", "weight_decay")} == \
        {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    from dslaunch.runtime.core.muon import newton_schulz as ns

    g = torch.Generator().manual_seed(0)
    # (5, 7) beside the stacks (2, 5, 7) and (3, 5, 7): a 2-D weight and stacked expert weights
    # of the same matrix shape go through one batch (AutoEP's experts beside the model's matrices)
    shapes = [(12, 48), (12, 48), (48, 12), (12, 12), (2, 5, 7), (4, 2, 3, 3), (12, 48), (5, 7), (3, 5, 7)]
    mats = [torch.randn(s, generator=g) for s in shapes]
    batched = ns.orthogonalize(mats, shapes, "gram", torch.float32)
    for m, s, got in zip(mats, shapes, batched):
        alone = ns.orthogonalize([m], [s], "gram", torch.float32)[0]
        assert torch.allclose(got, alone, atol=1e-6), s
    # near-orthogonal: the quintic leaves singular values around 1 (0.7-1.2 for a random matrix)
    sv = torch.linalg.svdvals(batched[0].view(12, 48))
    assert float(sv.min()) > 0.6 and float(sv.max()) < 1.3
    # the aspect factor sqrt(rows / cols) for tall matrices
    tall = torch.linalg.svdvals(batched[2].view(48, 12))
    assert float(tall.mean()) == pytest.approx(2 * float(sv.mean()), rel=0.1)


def test_gram_iteration_is_the_standard_polynomial():
    from dslaunch.runtime.core.muon import newton_schulz as ns

    X = torch.randn(3, 6, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    X = X / X.norm(dim=(-2, -1), keepdim=True)
    assert torch.allclose(ns._gram(X, 5), ns._standard(X, 5), atol=1e-10)


def test_whole_matrix_momentum_round_trips_where_its_length_is_the_partitions():
    """Stages 1-2 write Muon's momentum as DeepSpeed does, the whole of each matrix a rank's
    partition touches. On rank 1 of 2 here that is all of B (8 elements), the partition's own
    length (6 of B's elements and 2 of padding): the reader takes the whole-matrix layout for
    the momentum, so rank 1 gets B's last 6 elements back, not its first 6 (unless the run
    offloaded the optimizer, where DeepSpeed keeps the momentum over the partition)."""
    from dslaunch.runtime.checkpoint import dsformat

    shapes = {"A": [2, 3], "B": [2, 4]}  # 14 elements: partitions of 8, A and B[0:2] | B[2:8] + 2 padding
    b = torch.arange(8, dtype=torch.float32) + 100
    pieces = [{"name": "B", "start": 2, "end": 8, "offset": 0}]
    shard = {"format": dsformat.SHARD_FORMAT, "stage": 2, "world_size": 2, "rank": 1, "groups": [{
        "pieces": pieces, "shapes": shapes, "master": {"B": torch.zeros(6)}, "state": {"momentum_buffer": {"B": b[2:]}},
        "whole_state": {"momentum_buffer": {"B": b}}}]}
    optim = dsformat.zero_optim_states(shard, [{"use_muon": True, "lr": 0.02}], clip_grad=1.0,
                                       loss_scaler=dsformat.loss_scaler_record(), dynamic_loss_scale=False,
                                       sub_group_size=10 ** 9)
    written = optim["base_optimizer_state"]["state"][0]
    assert list(written) == ["momentum_buffer"] and torch.equal(written["momentum_buffer"], b)
    assert optim["group_paddings"] == [2] and optim["single_partition_of_fp32_groups"][0].numel() == 6
    back = dsformat.shard_from_ds(optim, [shapes], rank=1)["groups"][0]
    assert back["pieces"] == pieces and torch.equal(back["state"]["momentum_buffer"]["B"], b[2:])
    # under CPU offload DeepSpeed keeps Muon's momentum over the partition: a file whose config
    # offloads is read so; and SGD's momentum_buffer is always the partition's (no use_muon)
    optim["base_optimizer_state"]["state"][0]["momentum_buffer"] = torch.arange(8, dtype=torch.float32)
    back = dsformat.shard_from_ds(optim, [shapes], rank=1, offload=dsformat.offloaded(
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))["groups"][0]
    assert torch.equal(back["state"]["momentum_buffer"]["B"], torch.arange(6, dtype=torch.float32))
    optim["base_optimizer_state"]["param_groups"][0]["use_muon"] = False
    back = dsformat.shard_from_ds(optim, [shapes], rank=1)["groups"][0]
    assert torch.equal(back["state"]["momentum_buffer"]["B"], torch.arange(6, dtype=torch.float32))


def _engine(cfg, model=None):
    import dslaunch.runtime as deepspeed

    model = model or fx.make_model()
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


@pytest.mark.parametrize("params, match", [
    ({"per_head_muon": True}, "per_head_muon: per-head Newton-Schulz"),
    ({"ns_method": "exact"}, 'ns_method: must be one of "gram", "standard", got "exact"'),
    ({"nesterov": False}, "optimizer.params.nesterov: not a parameter of Muon"),
    ({"fp32_optimizer_states": False}, "fp32_optimizer_states"),
])
def test_refused_params(params, match):
    from dslaunch.runtime.strict import ConfigError

    cfg = fx.config(fx.Case(0, world=1))
    cfg["optimizer"]["params"].update(params)
    with pytest.raises(ConfigError, match=match):
        _engine(cfg)


def test_in_memory_momentum_needs_nvme():
    from dslaunch.runtime.strict import ConfigError

    cfg = fx.config(fx.Case(2, world=1))
    cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = True
    with pytest.raises(ConfigError, match="save_muon_momentum_buffer_in_memory: true keeps Muon's momentum out"):
        _engine(cfg)


def _state_bytes(opt):
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if torch.is_tensor(v) and k != "step")


def test_state_is_momentum_for_muon_and_two_moments_for_adam():
    """Between steps: 4 bytes per Muon element (momentum), 8 per Adam element, one rank's
    1/N of each under ZeRO; Adam alone would hold 8 per element."""
    engine = _engine(fx.config(fx.Case(0, world=1)))
    x, y = fx.batch(0, 0, 0, fx.Case(0, world=1))
    engine.backward(torch.nn.functional.cross_entropy(engine(x).reshape(-1, fx.VOCAB), y.reshape(-1)))
    engine.step()
    model = engine.module
    muon = sum(p.numel() for p in model.parameters() if p.use_muon)
    adam = sum(p.numel() for p in model.parameters() if not p.use_muon)
    assert _state_bytes(engine.optimizer) == 4 * muon + 8 * adam
    # the config's separate learning rates, on the halves initialize built
    assert sorted({(g["use_muon"], g["lr"]) for g in engine.optimizer.param_groups}) == [(False, 0.005), (True, 0.02)]
    assert {n for n, p in model.named_parameters() if p.use_muon} == {
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc1", "fc2")}


# -- DeepSpeed's losses ----------------------------------------------------------------------------
def test_every_case_has_its_fixture():
    for name, case in fx.CASES.items():
        assert len(EXPECTED[name]["deepspeed"]) == fx.STEPS, name
    assert sorted(EXPECTED["refused_by_deepspeed"]) == sorted(fx.REFUSED)
    assert EXPECTED["refused_by_deepspeed"]["s3_fp32_reduce_scatter"]["error"].endswith(
        "ValueError: Muon and reduce scatter cannot be used together")


def _config(case, clip):
    cfg = fx.config(case)
    if clip is not None:
        cfg["gradient_clipping"] = clip
    return cfg


def run_cases(names, save_root=None, clip=None):
    """Each case's losses on this process group; with save_root, also a checkpoint at SAVE_AT."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name in names:
        case = (fx.CASES.get(name) or fx.REFUSED[name])._replace(world=dist.get_world_size())
        engine = _engine(_config(case, clip))
        save = os.path.join(save_root, name) if save_root else None
        out[name] = fx.train(engine, case, rank, 0, fx.STEPS, save=save)
        engine.destroy()
    return out


def resume_cases(plans, root, clip=None):
    """Resume each (case, stage) plan's checkpoint on this process group at `stage`."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for name, stage, load_optimizer in plans:
        case = fx.CASES[name]._replace(world=dist.get_world_size(), stage=stage)
        engine = _engine(_config(case, clip))
        engine.load_checkpoint(os.path.join(root, name), load_optimizer_states=load_optimizer)
        assert engine.global_steps == fx.SAVE_AT
        out[f"{name}->{stage}/{load_optimizer}"] = fx.train(engine, case, rank, fx.SAVE_AT, fx.STEPS)
        engine.destroy()
    return out


def _tol(name):
    case = fx.CASES[name]
    return STANDARD_TOL if case.ns_method == "standard" else TOL[case.dtype]


def _check(outs, names):
    for name in names:
        assert outs[0][name] == pytest.approx(EXPECTED[name]["deepspeed"], rel=_tol(name), abs=_tol(name)), name


def _names(world):
    return sorted(n for n, c in fx.CASES.items() if c.world == world)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank case once (the one DeepSpeed refuses too), each saved at SAVE_AT: the losses,
    and the checkpoints the resume tests below start from."""
    root = tmp_path_factory.mktemp("muon-2-ranks")
    names = _names(2) + sorted(fx.REFUSED)
    outs = run_function(run_cases, nprocs=2, kwargs={"names": names, "save_root": str(root)}, timeout=800)
    return outs[0], root


@pytest.mark.timeout(900)
def test_losses_equal_deepspeeds_on_two_ranks(two_ranks):
    _check([two_ranks[0]], _names(2))


@pytest.mark.timeout(600)
def test_losses_equal_deepspeeds_on_three_ranks():
    names = _names(3)
    outs = run_function(run_cases, nprocs=3, kwargs={"names": names}, timeout=500)
    _check(outs, names)


@pytest.mark.timeout(900)
def test_stage3_runs_with_reduce_scatter_where_deepspeed_refuses(two_ranks):
    got = two_ranks[0]["s3_fp32_reduce_scatter"]
    assert got == pytest.approx(EXPECTED["s3_fp32"]["deepspeed"], rel=1e-5, abs=1e-5)


# -- checkpoints: the momentum resumes at another world size and stage --------------------------------
# (saved case, stage to resume at) on 1 rank and on 3 ranks. Stage 0 clips the raw gradient and
# stages 1-3 the update (DeepSpeed's rule), so DeepSpeed's losses continue only within either
# side; test_checkpoints_cross_between_stage0_and_zero crosses over without clipping.
RESUME = {1: [("s2_fp32", 1), ("s3_fp32", 2), ("s0_fp32", 0), ("s1_fp32_offload", 2)],
          3: [("s2_fp32", 2), ("s3_fp32", 1), ("s0_fp32", 0)]}


@pytest.mark.timeout(1200)
def test_checkpoints_resume_at_other_world_sizes_with_deepspeeds_losses(two_ranks):
    root = two_ranks[1]
    for world, plans in RESUME.items():
        plans = [(name, stage, True) for name, stage in plans]
        if world == 1:  # without the momentum the run differs: the checkpoint's momentum is what matches
            plans.append(("s2_fp32", 2, False))
        outs = run_function(resume_cases, nprocs=world, kwargs={"plans": plans, "root": str(root)}, timeout=500)
        for key, got in outs[0].items():
            name = key.split("->")[0]
            want = EXPECTED[name]["deepspeed"][fx.SAVE_AT:]
            if key.endswith("/False"):
                assert got != pytest.approx(want, rel=1e-3), key
            else:
                assert got == pytest.approx(want, rel=TOL["fp32"], abs=TOL["fp32"]), (key, world)


@pytest.mark.timeout(900)
def test_checkpoints_cross_between_stage0_and_zero(tmp_path):
    """Without clipping stage 0 and ZeRO take the same steps: a stage-0 checkpoint resumes
    under ZeRO and a ZeRO one under stage 0 (1 rank, saved on 2) with the uninterrupted losses."""
    saved = run_function(run_cases, nprocs=2, kwargs={"names": ["s0_fp32", "s2_fp32"], "save_root": str(tmp_path),
                                                      "clip": 0.0}, timeout=800)[0]
    assert saved["s0_fp32"] == pytest.approx(saved["s2_fp32"], rel=1e-5)
    got = run_function(resume_cases, nprocs=1, timeout=800, kwargs={
        "plans": [("s0_fp32", 2, True), ("s0_fp32", 3, True), ("s2_fp32", 0, True)], "root": str(tmp_path),
        "clip": 0.0})[0]
    for key, losses in got.items():
        assert losses == pytest.approx(saved[key.split("->")[0]][fx.SAVE_AT:], rel=1e-5, abs=1e-5), key


# -- DeepSpeed's own Muon checkpoints resume here ---------------------------------------------------
DS_DATA = os.path.join(DATA, "ds")
# (DeepSpeed's case, the stage to resume at) on 1 and on 2 ranks
DS_RESUME = {1: [("s0_fp32", 0), ("s2_fp32", 2), ("s2_fp32", 1), ("s3_fp32", 1)],
             2: [("s0_fp32", 0), ("s1_fp32", 1), ("s2_fp32", 3), ("s3_fp32", 3)]}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", sorted(DS_RESUME))
def test_deepspeed_checkpoints_resume_with_deepspeeds_losses(world):
    plans = [(name, stage, True) for name, stage in DS_RESUME[world]]
    outs = run_function(resume_cases, nprocs=world, kwargs={"plans": plans, "root": DS_DATA}, timeout=800)
    for key, got in outs[0].items():
        want = EXPECTED[key.split("->")[0]]["deepspeed"][fx.SAVE_AT:]
        assert got == pytest.approx(want, rel=TOL["fp32"], abs=TOL["fp32"]), (key, world)


# -- dslaunch's Muon checkpoints resume under DeepSpeed --------------------------------------------
OURS_DATA = os.path.join(DATA, "dslaunch")


def _comparable(obj, tensors):
    """A checkpoint file's structure (keys, types, dtypes, shapes), its tensors appended in order."""
    if isinstance(obj, dict):
        return {k: _comparable(v, tensors) for k, v in obj.items() if k != "ds_config"}
    if isinstance(obj, (list, tuple)):
        return [_comparable(v, tensors) for v in obj]
    if torch.is_tensor(obj):
        tensors.append(obj.detach().float())
        return ("tensor", obj.dtype, tuple(obj.shape))
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__name__, _comparable(vars(obj), tensors))
    return obj


# DeepSpeed 0.19.8 resumes dslaunch's Muon checkpoints at every stage (recorded by the fixture
# script). At stages 1-2 that needs DeepSpeed's layout of the momentum: each rank's file holds the
# whole momentum of every matrix its partition touches (test_stage12_momentum_is_deepspeeds_layout).
# The fixture script's ranks ran with torch's default thread count, the harness's with one: matmuls
# block differently, and three Newton-Schulz steps carry the last-bit differences to 7e-4 of a
# tensor's scale (an Adam second moment at stage 0); the losses still agree to 1e-5.
FILE_TOL = 2e-3


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", fx.OURS_SAVED)
def test_deepspeed_resumed_dslaunchs_checkpoints_and_dslaunch_still_writes_them(two_ranks, name):
    """The fixture script had DeepSpeed 0.19.8 resume dslaunch's checkpoint of each case on the
    same 2 ranks: at stages 0 and 3 it continued with dslaunch's uninterrupted losses. dslaunch
    writes that checkpoint today, file for file: the same keys, dtypes and shapes, and values within
    FILE_TOL of each tensor's scale."""
    from dslaunch.runtime.checkpoint.files import load_torch

    exp = EXPECTED[name]
    assert "deepspeed_resumed_dslaunch_error" not in exp, exp.get("deepspeed_resumed_dslaunch_error")
    # DeepSpeed's steps after the resume are the ones dslaunch took without stopping, in the
    # fixture run and on this machine
    uninterrupted = two_ranks[0][name][fx.SAVE_AT:]
    assert exp["deepspeed_resumed_dslaunch"] == pytest.approx(exp["dslaunch"][fx.SAVE_AT:], rel=TOL["fp32"],
                                                              abs=TOL["fp32"]), name
    assert exp["deepspeed_resumed_dslaunch"] == pytest.approx(uninterrupted, rel=TOL["fp32"], abs=TOL["fp32"]), name
    # dslaunch's own losses in the fixture run are the ones this machine reproduces
    assert two_ranks[0][name] == pytest.approx(exp["dslaunch"], rel=TOL["fp32"], abs=TOL["fp32"])
    tag = f"global_step{fx.SAVE_AT}"
    committed, fresh = os.path.join(OURS_DATA, name, tag), os.path.join(two_ranks[1], name, tag)
    files = sorted(n for n in os.listdir(committed) if not n.startswith("rng_state") and n != "manifest.json")
    assert files == sorted(n for n in os.listdir(fresh) if not n.startswith("rng_state") and n != "manifest.json")
    assert any("optim_states" in f for f in files) or name == "s0_fp32"
    for f in files:
        ta, tb = [], []
        assert _comparable(load_torch(os.path.join(committed, f)), ta) == \
            _comparable(load_torch(os.path.join(fresh, f)), tb), (name, f)
        for a, b in zip(ta, tb):
            scale = float(a.abs().max()) if a.numel() else 0.0
            assert torch.allclose(b, a, rtol=FILE_TOL, atol=FILE_TOL * scale), (name, f)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [n for n in fx.DS_SAVED if fx.CASES[n].stage in (1, 2)])
def test_stage12_momentum_is_deepspeeds_layout(two_ranks, name):
    """At stages 1-2 each rank's optimizer-state file holds Muon's momentum as DeepSpeed 0.19.8's
    own checkpoint of the same run does: the whole of every matrix the rank's partition touches,
    end to end (a matrix across the boundary on both ranks), with the same partition bookkeeping;
    values as DeepSpeed's within FILE_TOL. (The Adam group is written in torch AdamW's form, which
    DeepSpeed loads as well: test_deepspeed_resumed_dslaunchs_checkpoints_...)."""
    from dslaunch.runtime.checkpoint.files import load_torch

    def muon_part(optim):  # the Muon group's state and settings, and the partition bookkeeping
        base = optim["base_optimizer_state"]
        return {"state": base["state"][0], "group": base["param_groups"][0],
                **{k: optim[k] for k in ("single_partition_of_fp32_groups", "group_paddings", "partition_count",
                                         "zero_stage", "param_alignment_paddings")}}

    tag = f"global_step{fx.SAVE_AT}"
    for rank in range(2):
        f = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        ours = load_torch(os.path.join(two_ranks[1], name, tag, f))["optimizer_state_dict"]
        theirs = load_torch(os.path.join(DS_DATA, name, tag, f))["optimizer_state_dict"]
        ta, tb = [], []
        want = _comparable(muon_part(theirs), ta)
        assert _comparable(muon_part(ours), tb) == want, (name, rank)
        momentum = theirs["base_optimizer_state"]["state"][0]["momentum_buffer"]
        assert momentum.numel() > ours["single_partition_of_fp32_groups"][0].numel()  # a matrix crosses
        for a, b in zip(ta, tb):
            scale = float(a.abs().max()) if a.numel() else 0.0
            assert torch.allclose(b, a, rtol=FILE_TOL, atol=FILE_TOL * scale), (name, rank)


# -- NVMe offload, the in-memory momentum, whole-parameter access ------------------------------------
def offload_and_fragments(nvme_root):
    """Losses under NVMe offload (the momentum in the files, then kept in memory), and the
    momentum read whole at stage 2 next to stage 3's (the same run), and at stage 0."""
    import torch.distributed as dist

    from dslaunch.runtime.utils import safe_get_full_optimizer_state

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for stage in (2, 3):
        for in_memory in (False, True):
            case = fx.CASES[f"s{stage}_fp32"]._replace(world=world)
            cfg = fx.config(case)
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme",
                                                             "nvme_path": os.path.join(nvme_root, str(rank))}
            cfg["zero_optimization"]["save_muon_momentum_buffer_in_memory"] = in_memory
            engine = _engine(cfg)
            losses = fx.train(engine, case, rank, 0, fx.STEPS)
            host = engine.strategy.host
            on_disk = [torch.load(host._path(ui), weights_only=True) for ui in range(len(host.units))
                       if host.on_disk[ui]]
            out[f"s{stage}/{in_memory}"] = {"losses": losses,
                                            "momentum_in_files": any("momentum_buffer" in st for st in on_disk)}
            engine.destroy()
    moments = {}
    for stage in (0, 2, 3):
        case = fx.CASES[f"s{stage}_fp32"]._replace(world=world)
        engine = _engine(fx.config(case))
        fx.train(engine, case, rank, 0, 2)
        moments[stage] = {n: safe_get_full_optimizer_state(p, "momentum_buffer")
                          for n, p in engine.module.named_parameters() if p.use_muon}
        engine.destroy()
    out["same_momentum"] = all(torch.allclose(moments[3][n], moments[2][n], atol=1e-6) for n in moments[2])
    out["momentum_norm"] = float(sum(m.norm() for m in moments[2].values()))
    shapes = {n: p.shape for n, p in fx.make_model().named_parameters()}
    out["stage0_shapes"] = sorted(moments[0]) == sorted(moments[2]) and \
        all(moments[0][n].shape == shapes[n] for n in moments[0])
    return out


@pytest.mark.timeout(900)
def test_nvme_offload_and_the_in_memory_momentum(tmp_path):
    outs = run_function(offload_and_fragments, nprocs=2, kwargs={"nvme_root": str(tmp_path)}, timeout=800)
    got = outs[0]
    for stage in (2, 3):
        want = EXPECTED[f"s{stage}_fp32"]["deepspeed"]
        for in_memory in (False, True):
            run = got[f"s{stage}/{in_memory}"]
            assert run["losses"] == pytest.approx(want, rel=TOL["fp32"], abs=TOL["fp32"]), (stage, in_memory)
            assert run["momentum_in_files"] is not in_memory, (stage, in_memory)
    assert got["same_momentum"] and got["momentum_norm"] > 0 and got["stage0_shapes"]


def test_fp16_momentum_holds_true_gradients_whatever_the_loss_scale():
    """Under ZeRO the update replaces the gradient before the loss scale is divided out: the
    momentum is fed unscaled gradients, so runs whose loss scale differs, and doubles after every
    step (loss_scale_window 1), take the same steps (and, without clipping, the steps stage 0
    takes); momentum mixing gradients of different scales would not."""
    case = fx.Case(2, world=1)
    runs = {}
    for stage, power in ((2, 4), (2, 8), (0, 4)):
        cfg = fx.config(case._replace(stage=stage))
        cfg.update(fp16={"enabled": True, "initial_scale_power": power, "loss_scale_window": 1},
                   gradient_clipping=0.0)
        if stage:  # fp32 partitions, as stage 0 has no fp16 sums of its own to compare with
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        engine = _engine(cfg)
        runs[(stage, power)] = fx.train(engine, case._replace(stage=stage), 0, 0, fx.STEPS)
        assert engine.skipped_steps == 0
    # fp16 rounds the scaled gradients differently at each scale (2e-5 apart); momentum of scaled
    # gradients would be 1e-4 apart, and 1e-4 from stage 0's, which unscales before its step
    assert runs[(2, 4)] == pytest.approx(runs[(2, 8)], rel=5e-5)
    assert runs[(2, 4)] == pytest.approx(runs[(0, 4)], rel=1e-5)
    assert runs[(2, 4)][-1] < runs[(2, 4)][0]
