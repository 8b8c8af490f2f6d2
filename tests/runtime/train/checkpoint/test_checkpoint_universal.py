"""Universal checkpoints both ways (issue #23 section 2), against fixtures real DeepSpeed 0.19.8
made (scripts/make_ds_universal_fixtures.py; DeepSpeed is not needed here).

- DeepSpeed -> dslaunch: the folders DeepSpeed's own ds_to_universal wrote from its 2-rank
  checkpoints (ZeRO 1-3, fp32/bf16, torch's AdamW and its FusedAdam) resume here with
  "checkpoint": {"load_universal": true} on 1 and on 2 ranks, in their own ZeRO stage and
  another, with the losses of DeepSpeed's uninterrupted run.
- dslaunch -> DeepSpeed: DeepSpeed resumed, on 1 rank and at two ZeRO stages, the folder our
  converter wrote from dslaunch's 2-rank checkpoint (those cases, and a stage-0 one DeepSpeed's
  converter refuses), with its own losses (fixture script); our
  converter still writes that folder today, tensor for tensor. Our converter run on
  DeepSpeed's checkpoint writes what DeepSpeed's converter wrote from it.
- `dslaunch ds_to_universal`, `python -m deepspeed.checkpoint.ds_to_universal` (DeepSpeed's
  arguments); bad input and a missing latest_universal are one line.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
DATA = os.path.join(ROOT, "tests", "data", "ds_universal")
INTEROP = os.path.join(ROOT, "tests", "data", "ds_interop")
fx = load_script("make_ds_fixtures")
ux = load_script("make_ds_universal_fixtures")

with open(os.path.join(DATA, "expected.json")) as _fh:
    EXPECTED = json.load(_fh)
TOL = {"fp32": 1e-5, "bf16": 2e-2}
OTHER_STAGE = {0: 3, 1: 2, 2: 0, 3: 1}  # we resume each folder in its own stage and this one


def _universal(who, case):
    return os.path.join(DATA, who, case, ux.UNIVERSAL.format(tag=fx.CASES[case].tag))


def resume_body(data, cases):
    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for case in cases:
        c = fx.CASES[case]
        for stage in (c.stage, OTHER_STAGE[c.stage]):
            cfg = fx.config(stage, c.dtype, world, c.optimizer)
            cfg["checkpoint"] = {"load_universal": True}
            model = fx.make_model()
            engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
            path, client = engine.load_checkpoint(os.path.join(data, case))  # tag from latest_universal
            losses = []
            tdtype = torch.bfloat16 if c.dtype == "bf16" else torch.float32
            for step in range(engine.global_steps, c.steps):
                x, y = fx.batch(step, rank, world, tdtype)
                loss = (engine(x).float() - y).pow(2).mean()
                engine.backward(loss)
                engine.step()
                total = loss.detach().float().clone()
                if world > 1:
                    dist.all_reduce(total)
                losses.append(float(total) / world)
            out[f"{case}->{stage}"] = {"losses": losses, "client": client, "path": os.path.basename(path)}
            engine.destroy()
    return out


def _check(outs, who):
    for key, got in outs[0].items():
        case = key.split("->")[0]
        c = fx.CASES[case]
        want = EXPECTED[case]["deepspeed"]
        assert len(want) == 3 and got["losses"] == pytest.approx(want, rel=TOL[c.dtype]), (key, got, want)
        assert got["client"] == {"epoch": 1, "source": who}, key
        assert got["path"] == ux.UNIVERSAL.format(tag=c.tag)


def test_fixtures_cover_the_cases_and_deepspeed_resumed_ours_with_its_losses():
    assert sorted(EXPECTED) == sorted(ux.CASES + ux.OURS_ONLY)
    for case in ux.CASES + ux.OURS_ONLY:
        c = fx.CASES[case]
        exp = dict(EXPECTED[case])
        ours = {f"deepspeed_resumed_dslaunch_universal_stage{ux.SAME_STAGE.get(c.stage, c.stage)}",
                f"deepspeed_resumed_dslaunch_universal_stage{ux.OTHER_STAGE[c.stage]}"}
        if case in ux.OURS_ONLY:  # DeepSpeed's converter refuses stage 0: no optimizer files
            assert "can't find *_optim_states.pt files" in exp.pop("deepspeed_converter_error"), case
            assert set(exp) == {"deepspeed"} | ours and not os.path.exists(os.path.join(DATA, "ds", case)), case
        else:
            assert set(exp) == {"deepspeed", "deepspeed_resumed_ds_universal"} | ours, case
        for key in exp:  # DeepSpeed on 1 rank, from either converter's folder, reproduced its 2-rank run
            assert exp[key] == pytest.approx(exp["deepspeed"], rel=TOL[c.dtype]), (case, key)
        for who in ("ds", "dslaunch") if case in ux.CASES else ("dslaunch",):
            with open(os.path.join(DATA, who, case, "latest_universal")) as fh:
                assert fh.read() == ux.UNIVERSAL.format(tag=c.tag)


@pytest.mark.timeout(600)
def test_deepspeeds_universal_folders_resume_here_on_one_rank_in_any_stage():
    outs = run_function(resume_body, nprocs=1, kwargs={"data": os.path.join(DATA, "ds"), "cases": list(ux.CASES)},
                        timeout=500)
    assert len(outs[0]) == 2 * len(ux.CASES)
    _check(outs, "deepspeed")


@pytest.mark.timeout(600)
def test_our_universal_folders_resume_here_on_two_ranks():
    outs = run_function(resume_body, nprocs=2, kwargs={"data": os.path.join(DATA, "dslaunch"),
                                                       "cases": ["s3_fp32", "adam_s1_bf16", "s0_bf16"]},
                        timeout=500)
    _check(outs, "dslaunch")


def _load(path):
    from dslaunch.runtime.checkpoint.universal import open_universal

    return open_universal(path)


def _same_universal(a, b, rel, where, optimizer_only=False):
    """Two universal folders hold the same parameters, states, steps and param_groups."""
    names = sorted(n for n, e in a.params.items() if not optimizer_only or len(e) > 1)
    assert names == sorted(n for n, e in b.params.items() if not optimizer_only or len(e) > 1), where
    for n in names:
        assert sorted(a.params[n]) == sorted(b.params[n]) or optimizer_only and \
            sorted(k for k in a.params[n] if k != "step") == sorted(k for k in b.params[n] if k != "step"), (where, n)
        for k, x in a.params[n].items():
            if k == "step":
                continue
            y = b.params[n][k]
            assert x.shape == y.shape and x.dtype == y.dtype, (where, n, k)
            assert torch.allclose(y, x, rtol=rel, atol=rel * float(x.abs().max())), (where, n, k)
    assert float(a.step) == float(b.step), where
    assert a.param_groups() == b.param_groups(), where


@pytest.mark.parametrize("case", ux.CASES + ux.OURS_ONLY)
def test_our_converter_writes_what_deepspeed_resumed_and_what_deepspeeds_converter_writes(tmp_path, case):
    from dslaunch.runtime.checkpoint.universal import convert

    c = fx.CASES[case]
    out = tmp_path / "ours" / ux.UNIVERSAL.format(tag=c.tag)
    convert(os.path.join(INTEROP, "dslaunch", case, c.tag), str(out))
    assert (tmp_path / "ours" / "latest_universal").read_text() == out.name
    # the committed folder is the one DeepSpeed resumed with its own losses (fixture script)
    _same_universal(_load(_universal("dslaunch", case)), _load(str(out)), TOL[c.dtype], case)
    assert sorted(os.listdir(out)) == sorted(os.listdir(_universal("dslaunch", case)))
    if case in ux.OURS_ONLY:
        return
    # from DeepSpeed's checkpoint, ours and DeepSpeed's converter agree (DeepSpeed's ZeRO-3 converter
    # writes no buffers and keeps the step in optimizer_state.pt: parameters with state compared)
    mine = tmp_path / "from_ds" / "u"
    convert(os.path.join(INTEROP, "ds", case), str(mine))  # a save dir: its `latest` names the tag
    _same_universal(_load(_universal("ds", case)), _load(str(mine)), 0.0, case, optimizer_only=True)
    step = torch.load(mine / "zero" / "inp.weight" / "step.pt", weights_only=True)
    # the step in the form the saving optimizer kept it: FusedAdam's int, torch's AdamW's tensor
    assert isinstance(step, int) if c.optimizer == "adam" else torch.is_tensor(step), type(step)


def _cli(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)


def test_dslaunch_ds_to_universal_subcommand(tmp_path):
    c = fx.CASES["s2_fp32"]
    res = _cli([sys.executable, "-m", "dslaunch.launcher.main", "ds_to_universal", "--input_folder",
                os.path.join(INTEROP, "ds", "s2_fp32", c.tag), "--output_folder", str(tmp_path / "u"),
                "--num_extract_workers", "2", "--inject_missing_state"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"wrote {tmp_path / 'u'}: 4 parameters (fp32, exp_avg, exp_avg_sq, step)")
    assert (tmp_path / "latest_universal").read_text() == "u"


@pytest.mark.parametrize("source, why", [("nope", "not a directory"), ("pipe_s1_fp32", "pipeline"),
                                         ("s0_fp32", "records no parameter names")])
def test_ds_to_universal_bad_input_is_one_line(tmp_path, source, why):
    from click.testing import CliRunner

    from dslaunch.runtime.checkpoint.ds_to_universal import ds_to_universal

    res = CliRunner().invoke(ds_to_universal, ["--input_folder", os.path.join(INTEROP, "ds", source),
                                               "--output_folder", str(tmp_path / "v")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and why in res.stderr, res.stderr
    assert res.stderr.startswith("ds_to_universal: ") and not (tmp_path / "v").exists()
    res = CliRunner().invoke(ds_to_universal, ["--output_folder", "x"])
    assert res.exit_code == 2 and "--input_folder" in res.stderr


@pytest.mark.parametrize("flag", ["--keep_temp_folder", "--no_strict"])
def test_ds_to_universal_refuses_flags_that_cannot_apply(tmp_path, flag):
    from click.testing import CliRunner

    from dslaunch.runtime.checkpoint.ds_to_universal import ds_to_universal, main, parse_arguments

    src = os.path.join(INTEROP, "ds", "s2_fp32", fx.CASES["s2_fp32"].tag)
    res = CliRunner().invoke(ds_to_universal, ["--input_folder", src, "--output_folder", str(tmp_path / "v"), flag])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"ds_to_universal: {flag}: ") and not (tmp_path / "v").exists()
    with pytest.raises(SystemExit) as exc:  # DeepSpeed's own entry: parse_arguments() then main(args)
        main(parse_arguments(["--input_folder", src, "--output_folder", str(tmp_path / "v"), flag]))
    assert exc.value.code == 2 and not (tmp_path / "v").exists()


def test_ds_to_universal_workers_and_injected_state(tmp_path):
    from dslaunch.runtime.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from dslaunch.runtime.checkpoint.ds_to_universal import main, parse_arguments
    from dslaunch.runtime.checkpoint.universal import convert
    from dslaunch.runtime.checkpoint import CheckpointError

    src = os.path.join(INTEROP, "dslaunch", "s3_fp32", "global_step3")
    main(parse_arguments(["--input_folder", src, "--output_folder", str(tmp_path / "one"),
                          "--num_extract_workers", "1", "--num_merge_workers", "1"]))
    main(parse_arguments(["--input_folder", src, "--output_folder", str(tmp_path / "many"),
                          "--num_extract_workers", "3", "--num_merge_workers", "5", "--inject_missing_state"]))
    _same_universal(_load(str(tmp_path / "one")), _load(str(tmp_path / "many")), 0.0, "threads")
    states = "mp_rank_00_model_states.pt"
    plain = torch.load(tmp_path / "one" / states, weights_only=False)
    injected = torch.load(tmp_path / "many" / states, weights_only=False)
    assert UNIVERSAL_CHECKPOINT_INFO not in plain
    assert injected[UNIVERSAL_CHECKPOINT_INFO] == {"universal_checkpoint_version": 0.4}
    with pytest.raises(CheckpointError, match="--num_merge_workers must be a whole number >= 1, got 0"):
        convert(src, str(tmp_path / "zero"), merge_workers=0)


def test_deepspeed_checkpoint_ds_to_universal_under_the_compat_package(deepspeed_compat, tmp_path):
    res = _cli([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                os.path.join(INTEROP, "dslaunch", "s3_fp32", "global_step3"), "--output_folder", str(tmp_path / "u")],
               env=deepspeed_compat.env())
    assert res.returncode == 0, res.stderr[-3000:]
    _same_universal(_load(_universal("dslaunch", "s3_fp32")), _load(str(tmp_path / "u")), 1e-5, "compat")


def misuse_body(data, plain):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint import CheckpointError

    out = []
    for universal, where in ((True, plain), (False, os.path.join(data, "s2_fp32"))):
        cfg = fx.config(2, "fp32", 1)
        if universal:
            cfg["checkpoint"] = {"load_universal": True}
        model = fx.make_model()
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        try:
            engine.load_checkpoint(where, tag=None if universal else "global_step3_universal")
            out.append("loaded")
        except CheckpointError as exc:
            out.append(str(exc))
        engine.destroy()
    return out


def test_load_universal_without_latest_universal_and_a_universal_folder_without_the_flag_are_one_line():
    outs = run_function(misuse_body, nprocs=1, timeout=300,
                        kwargs={"data": os.path.join(DATA, "ds"), "plain": os.path.join(INTEROP, "ds", "s2_fp32")})
    missing, unflagged = outs[0]
    assert "checkpoint.load_universal is set but" in missing and "latest_universal does not exist" in missing
    assert "is a universal checkpoint; load it with" in unflagged and "load_universal" in unflagged


def test_buffers_and_frozen_weights_come_from_the_module_states_and_placeholders_from_fp32():
    from dslaunch.runtime.checkpoint.universal import UniversalCheckpoint

    big = torch.tensor([2 ** 40 + 1], dtype=torch.int64)  # fp32 cannot hold it: DeepSpeed's fp32.pt rounds it
    uc = UniversalCheckpoint("u", {"module": {"w": torch.empty(0, dtype=torch.bfloat16), "count": big,
                                              "frozen": torch.ones(2, dtype=torch.bfloat16)}},
                             {"param_groups": [{"lr": 0.1, "params": [0]}]},
                             {"w": {"fp32": torch.arange(4.0).view(2, 2), "exp_avg": torch.ones(2, 2), "step": 3},
                              "count": {"fp32": big.float()}, "frozen": {"fp32": torch.full((2,), 7.0)}})
    module = uc.module_state()
    assert torch.equal(module["count"], big) and torch.equal(module["frozen"], torch.ones(2, dtype=torch.bfloat16))
    assert module["w"].dtype == torch.bfloat16 and torch.equal(module["w"].float(), torch.arange(4.0).view(2, 2))
    shard = uc.shard()
    assert [g["state"].get("step") for g in shard["groups"]] == [3] and shard["param_groups"] == [{"lr": 0.1}]
    assert torch.equal(shard["groups"][0]["state"]["exp_avg"]["w"], torch.ones(4))


def crafted_body(folders):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint import CheckpointError

    cfg = fx.config(2, "fp32", 1)
    cfg["checkpoint"] = {"load_universal": True}
    model = fx.make_model()
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    out = {}
    for how, folder in folders.items():
        before = [p.detach().clone() for p in engine.module.parameters()]
        try:
            engine.load_checkpoint(folder)
            out[how] = "loaded"
        except CheckpointError as exc:
            out[how] = str(exc)
            out[how + "_untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.destroy()
    return out


def test_crafted_universal_folders_are_refused_naming_the_file_and_key(tmp_path):
    """NaN in a moment, int64 where fp32 belongs, `zero/` or one file linked out of the
    checkpoint: each loaded without a word; now one line naming the file (and the key)."""
    import shutil

    src = os.path.join(DATA, "ds", "s2_fp32")
    tag = "global_step3_universal"
    folders = {}
    for how in ("intact", "nan", "int64", "zero_link", "file_link"):
        folder = tmp_path / how
        shutil.copytree(src, folder)
        folders[how] = str(folder)
        zero = folder / tag / "zero"
        if how == "nan":
            f = zero / "inp.weight" / "exp_avg.pt"
            d = torch.load(f, weights_only=True)
            d["param"][0, 0] = float("nan")
            torch.save(d, f)
        elif how == "int64":
            f = zero / "inp.weight" / "fp32.pt"
            d = torch.load(f, weights_only=True)
            d["param"] = d["param"].round().to(torch.int64)
            torch.save(d, f)
        elif how == "zero_link":  # the same data, kept outside the checkpoint
            shutil.move(zero, tmp_path / "elsewhere_zero")
            zero.symlink_to(tmp_path / "elsewhere_zero")
        elif how == "file_link":
            f = zero / "inp.weight" / "fp32.pt"
            shutil.move(f, tmp_path / "elsewhere_fp32.pt")
            f.symlink_to(tmp_path / "elsewhere_fp32.pt")
    out = run_function(crafted_body, nprocs=1, timeout=300, kwargs={"folders": folders})[0]
    root = lambda how: f"{tmp_path}/{how}/{tag}"  # noqa: E731
    assert out["intact"] == "loaded"
    assert out["nan"] == (f"universal checkpoint file {root('nan')}/zero/inp.weight/exp_avg.pt: inp.weight exp_avg "
                          "holds 1 NaN or infinite value(s) of 45; refusing to load it")
    assert out["int64"] == (f"universal checkpoint file {root('int64')}/zero/inp.weight/fp32.pt: inp.weight fp32 "
                            "holds int64, where a floating-point tensor belongs")
    assert out["zero_link"] == (f"checkpoint file {root('zero_link')}/zero/optimizer_state.pt resolves to "
                                f"{tmp_path}/elsewhere_zero/optimizer_state.pt, outside the checkpoint "
                                f"{root('zero_link')} (a link out of it); refusing to read it")
    assert out["file_link"] == (f"checkpoint file {root('file_link')}/zero/inp.weight/fp32.pt resolves to "
                                f"{tmp_path}/elsewhere_fp32.pt, outside the checkpoint {root('file_link')} (a link "
                                "out of it); refusing to read it")
    assert all(out[k + "_untouched"] for k in ("nan", "int64", "zero_link", "file_link"))


@pytest.mark.parametrize("output, why", [("link", "is the checkpoint being converted"),
                                         ("ck/global_step3/universal", "is inside the checkpoint")])
def test_ds_to_universal_refuses_an_output_that_is_or_is_inside_its_input(tmp_path, output, why):
    """A link to the input folder passed the old by-name comparison, and the converter then
    replaced the input's own model-states file."""
    import shutil

    from click.testing import CliRunner

    from dslaunch.runtime.checkpoint.ds_to_universal import ds_to_universal

    shutil.copytree(os.path.join(INTEROP, "ds", "s2_fp32"), tmp_path / "ck")
    (tmp_path / "link").symlink_to(tmp_path / "ck" / "global_step3")
    before = {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    res = CliRunner().invoke(ds_to_universal, ["--input_folder", str(tmp_path / "ck"),
                                               "--output_folder", str(tmp_path / output)])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and why in res.stderr, res.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()} == before
