"""DeepSpeed checkpoints both ways (issue #14 section 2, issue #23 section 1), against
fixtures that real DeepSpeed 0.19.8 wrote (scripts/make_ds_fixtures.py; DeepSpeed is not
needed here).

- DeepSpeed -> dslaunch: every DeepSpeed checkpoint (stages 0-3, fp32/bf16, saved on 2 ranks
  at step 3, one at step 6) resumes under dslaunch on 1 and on 2 ranks, into its own stage
  and another one, with the losses of DeepSpeed's uninterrupted run for the 3 steps after;
  client_state and global_steps come back. The optimizers DeepSpeed steps with: torch's
  AdamW (torch_adam), its default FusedAdam, DeepSpeedCPUAdam/CPULion/CPUAdagrad (offload)
  and torch's Adagrad, each resumed by the optimizer dslaunch builds for the same config.
- dslaunch -> DeepSpeed: DeepSpeed's load_checkpoint resumed each committed dslaunch
  checkpoint with dslaunch's own uninterrupted losses (recorded by the fixture script), and
  dslaunch still writes those checkpoints identically today (so DeepSpeed still reads them).
- Pipelines (2 stages, ZeRO-1): DeepSpeed's pipeline checkpoint resumes here at 2 stages and
  at 1 with DeepSpeed's losses; DeepSpeed's PipelineEngine resumed ours (fixture script).
- Consolidation both ways: `dslaunch consolidate` of DeepSpeed's checkpoints equals
  DeepSpeed's zero_to_fp32, and DeepSpeed's zero_to_fp32 of ours equals ours.
- DeepSpeed's pickled classes load through inert stand-ins; anything else is still refused.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
DATA = os.path.join(ROOT, "tests", "data", "ds_interop")
fx = load_script("make_ds_fixtures")

with open(os.path.join(DATA, "expected.json")) as _fh:
    EXPECTED = json.load(_fh)
CASES = sorted(fx.CASES)
OTHER_STAGE = {0: 2, 1: 3, 2: 0, 3: 1}
OTHER_OFFLOAD_STAGE = {1: 2, 2: 3, 3: 1}  # offload_optimizer needs ZeRO
TOL = {"fp32": 1e-5, "bf16": 2e-2}
# each test resumes one optimizer's cases (keeps each under its timeout on a 2-core machine)
BY_OPTIMIZER = sorted({c.optimizer for c in fx.CASES.values()})


def _cases(optimizer):
    return [name for name in CASES if fx.CASES[name].optimizer == optimizer]


def _other_stage(case):
    return (OTHER_OFFLOAD_STAGE if fx.OPTIMIZERS[case.optimizer][1] else OTHER_STAGE)[case.stage]


def _train(engine, rank, world, dtype, start, steps=fx.STEPS):
    import torch.distributed as dist

    losses = []
    tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    for step in range(start, steps):
        x, y = fx.batch(step, rank, world, tdtype)
        loss = (engine(x).float() - y).pow(2).mean()
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        if dist.is_initialized() and world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _engine(stage, dtype, world, optimizer="torch_adamw"):
    import dslaunch.runtime as deepspeed

    model = fx.make_model()
    return deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                config=fx.config(stage, dtype, world, optimizer))[0]


def interop_body(data, cases, rewrite_root=None):
    """Resume each DeepSpeed checkpoint here in its own stage and another; with
    rewrite_root, also redo dslaunch's fixture run and save it there."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for case in cases:
        c = fx.CASES[case]
        for target in (c.stage, _other_stage(c)):
            engine = _engine(target, c.dtype, world, c.optimizer)
            path, client = engine.load_checkpoint(os.path.join(data, "ds", case))
            out[f"{case}->{target}"] = {"losses": _train(engine, rank, world, c.dtype, engine.global_steps, c.steps),
                                        "client": client, "path": os.path.basename(path)}
            engine.destroy()
        if rewrite_root is not None:
            engine = _engine(c.stage, c.dtype, world, c.optimizer)
            _train_and_save(engine, rank, world, c, os.path.join(rewrite_root, case))
            engine.destroy()
    return out


def _train_and_save(engine, rank, world, case, save_dir):
    tdtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
    for step in range(case.save_at):
        x, y = fx.batch(step, rank, world, tdtype)
        engine.backward((engine(x).float() - y).pow(2).mean())
        engine.step()
    engine.save_checkpoint(save_dir, tag=case.tag, client_state={"epoch": 1, "source": "dslaunch"})


def _check_resumed(outs, world):
    for key, got in outs[0].items():
        case = fx.CASES[key.split("->")[0]]
        want = EXPECTED[key.split("->")[0]]["deepspeed"][case.save_at:]
        assert len(want) == 3 and got["losses"] == pytest.approx(want, rel=TOL[case.dtype]), (key, world, got, want)
        assert got["client"] == {"epoch": 1, "source": "deepspeed"}, key
        assert got["path"] == case.tag


def test_every_case_has_its_fixture():
    for name, case in fx.CASES.items():
        assert set(EXPECTED[name]) == {"deepspeed", "dslaunch", "deepspeed_resumed_dslaunch"}, name
        assert len(EXPECTED[name]["deepspeed"]) == case.steps, name
        for who in ("ds", "dslaunch"):
            assert os.path.isdir(os.path.join(DATA, who, name, case.tag)), (who, name)
    # what DeepSpeed cannot make on the CPU, with the error it stopped with
    recorded = EXPECTED["unsupported_by_deepspeed_on_cpu"]
    assert sorted(recorded) == sorted(fx.UNSUPPORTED)
    assert recorded["adam_s2_fp16"]["error"].endswith("ValueError: Type fp16 is not supported on your device.")
    for name in ("lion_s2_fp32", "lamb_s2_fp32"):  # FusedLion, FusedLamb: CUDA kernels only
        assert recorded[name]["error"].endswith("ValueError: This op had not been implemented on CPU backend.")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", BY_OPTIMIZER)
def test_deepspeed_checkpoints_resume_on_one_rank_into_any_stage(optimizer):
    outs = run_function(interop_body, nprocs=1, kwargs={"data": DATA, "cases": _cases(optimizer)}, timeout=500)
    assert len(outs[0]) == 2 * len(_cases(optimizer))
    _check_resumed(outs, 1)


# counters dslaunch records since these fixtures were made (the accumulation its micro steps count
# in, the data loader's sample offset: for a resume at another world size); in dslaunch's own
# "dslaunch" entry, which DeepSpeed hands back as client state and never reads
_NEWER_KEYS = ("gradient_accumulation_steps", "dataloader_offset")


def _comparable(obj, tensors):
    """A checkpoint file's structure without what legitimately varies between runs: every
    key, type, dtype and shape, with each tensor's values appended to `tensors` in order."""
    if isinstance(obj, dict):
        return {k: _comparable(v, tensors) for k, v in obj.items() if k not in ("ds_config",) + _NEWER_KEYS}
    if isinstance(obj, (list, tuple)):
        return [_comparable(v, tensors) for v in obj]
    if torch.is_tensor(obj):
        tensors.append(obj.detach().float())
        return ("tensor", obj.dtype, tuple(obj.shape))
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return (type(obj).__name__, _comparable(vars(obj), tensors))
    return obj


def _same_file(committed, fresh, rel, where):
    """The committed fixture file and today's, structure for structure; values equal up to
    `rel` of each tensor's scale: the fixture machine's CPU kernels (AVX-512 or AVX2 matmuls)
    round differently from this one's in the last bits, and bf16 tensors may then round one
    bf16 step apart."""
    from dslaunch.runtime.checkpoint.files import load_torch

    ta, tb = [], []
    assert _comparable(load_torch(committed), ta) == _comparable(load_torch(fresh), tb), where
    for i, (a, b) in enumerate(zip(ta, tb)):
        scale = float(a.abs().max()) if a.numel() else 0.0
        assert torch.allclose(b, a, rtol=rel, atol=rel * scale), (where, i, float((a - b).abs().max()), scale)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", BY_OPTIMIZER)
def test_deepspeed_checkpoints_resume_on_two_ranks_and_dslaunch_writes_what_deepspeed_resumed(tmp_path, optimizer):
    cases = _cases(optimizer)
    outs = run_function(interop_body, nprocs=2, timeout=500,
                        kwargs={"data": DATA, "cases": cases, "rewrite_root": str(tmp_path)})
    assert len(outs[0]) == 2 * len(cases)
    _check_resumed(outs, 2)
    for case in cases:
        c = fx.CASES[case]
        dtype = c.dtype
        exp = EXPECTED[case]
        # DeepSpeed's load_checkpoint resumed our checkpoint and reproduced our run (fixture script) ...
        assert exp["deepspeed_resumed_dslaunch"] == pytest.approx(exp["dslaunch"][c.save_at:], rel=TOL[dtype]), case
        # ... and what dslaunch writes today is that checkpoint, file for file.
        committed = os.path.join(DATA, "dslaunch", case, c.tag)
        fresh = tmp_path / case / c.tag
        names = sorted(n for n in os.listdir(committed) if not n.startswith("rng_state") and n != "manifest.json")
        assert names == sorted(n for n in os.listdir(fresh) if not n.startswith("rng_state") and n != "manifest.json")
        for name in names:
            _same_file(os.path.join(committed, name), str(fresh / name), TOL[dtype], (case, name))
        if c.stage > 0 and c.optimizer == "torch_adamw":
            # the zero_to_fp32.py the save put in the folder, run as DeepSpeed's is, gives what
            # DeepSpeed's zero_to_fp32 made of the same checkpoint
            out = tmp_path / "fp32" / case
            proc = subprocess.run([sys.executable, str(tmp_path / case / "zero_to_fp32.py"), str(tmp_path / case),
                                   str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path / case)
            assert proc.returncode == 0, proc.stderr
            _equal_state(torch.load(out / "pytorch_model.bin", weights_only=True),
                         torch.load(os.path.join(DATA, "fp32", f"{case}-dslaunch.pt"), weights_only=True),
                         rel=TOL[dtype])


def pipe_body(data, rewrite_root=None):
    """Resume DeepSpeed's pipeline checkpoints (2 stages) with this job's pipeline depth (one
    stage per rank); with rewrite_root, also redo dslaunch's fixture run and save it there."""
    import dslaunch.runtime as deepspeed

    world = int(os.environ["WORLD_SIZE"])
    out = {}
    for case, c in fx.PIPE_CASES.items():
        stage, dtype = c.stage, c.dtype
        tdtype = torch.bfloat16 if dtype == "bf16" else torch.float32

        def engine_():
            net = fx.make_pipe(deepspeed, world)
            return deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                        config=fx.pipe_config(stage, dtype))[0]

        engine = engine_()
        path, client = engine.load_checkpoint(os.path.join(data, "ds", case))
        out[case] = {"losses": [float(engine.train_batch(iter(fx.pipe_batches(s, tdtype))))
                                for s in range(engine.global_steps, fx.STEPS)],
                     "client": client, "path": os.path.basename(path)}
        engine.destroy()
        if rewrite_root is not None:
            engine = engine_()
            for s in range(fx.SAVE_AT):
                engine.train_batch(iter(fx.pipe_batches(s, tdtype)))
            engine.save_checkpoint(os.path.join(rewrite_root, case), tag=fx.TAG,
                                   client_state={"epoch": 1, "source": "dslaunch"})
            engine.destroy()
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stages", [2, 1])
def test_deepspeed_pipeline_checkpoints_resume_at_its_depth_and_another(tmp_path, stages):
    """2 stages: the same topology, rewritten file for file; 1 stage: layer files and both
    stages' ZeRO-1 shards re-cut for one rank."""
    from dslaunch.runtime.checkpoint.consolidate import consolidate_checkpoint

    rewrite = str(tmp_path) if stages == fx.PIPE_STAGES else None
    outs = run_function(pipe_body, nprocs=stages, timeout=500, kwargs={"data": DATA, "rewrite_root": rewrite})
    for case, c in fx.PIPE_CASES.items():
        dtype = c.dtype
        exp = EXPECTED[case]
        for got in outs:  # every stage reports the pipeline's loss
            assert got[case]["losses"] == pytest.approx(exp["deepspeed"][fx.SAVE_AT:], rel=TOL[dtype]), (case, stages)
            assert got[case]["client"] == {"epoch": 1, "source": "deepspeed"} and got[case]["path"] == fx.TAG
        # DeepSpeed's PipelineEngine resumed our pipeline checkpoint with our own losses (fixture script)
        assert exp["deepspeed_resumed_dslaunch"] == pytest.approx(exp["dslaunch"][fx.SAVE_AT:], rel=TOL[dtype])
        # consolidation of both tools' pipeline checkpoints (DeepSpeed's zero_to_fp32 fails on its own:
        # a pipeline's model states hold module None)
        ours, theirs = (consolidate_checkpoint(os.path.join(DATA, who, case)) for who in ("dslaunch", "ds"))
        assert sorted(ours) == sorted(theirs) == ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias", "3.weight"]
        if rewrite is not None:
            committed = os.path.join(DATA, "dslaunch", case, fx.TAG)
            fresh = tmp_path / case / fx.TAG
            names = sorted(n for n in os.listdir(committed) if not n.startswith("rng_state") and n != "manifest.json")
            assert names == sorted(n for n in os.listdir(fresh) if not n.startswith("rng_state")
                                   and n != "manifest.json")
            for name in names:
                _same_file(os.path.join(committed, name), str(fresh / name), TOL[dtype], (case, name))


def _equal_state(a, b, rel=0.0):
    assert list(a) == list(b) or set(a) == set(b), (sorted(a), sorted(b))
    for k in a:
        assert a[k].shape == b[k].shape, k
        scale = float(b[k].detach().float().abs().max()) if b[k].numel() else 0.0
        assert torch.allclose(a[k].float(), b[k].float(), rtol=rel, atol=rel * scale), k


def test_consolidation_matches_deepspeeds_zero_to_fp32_both_ways():
    from dslaunch.runtime.checkpoint.consolidate import consolidate_checkpoint

    for case in _cases("torch_adamw"):  # the optimizer does not change what is consolidated
        stage = fx.CASES[case].stage
        for who in ("ds", "dslaunch"):
            ours = consolidate_checkpoint(os.path.join(DATA, who, case))
            assert all(v.dtype == torch.float32 for v in ours.values()), (case, who)
            ref_path = os.path.join(DATA, "fp32", f"{case}-{who}.pt")
            if stage > 0:  # DeepSpeed's zero_to_fp32 reads ZeRO checkpoints only
                _equal_state(ours, torch.load(ref_path, weights_only=True))
            else:
                model = fx.make_model()
                assert set(ours) == set(model.state_dict()), case


def test_shipped_zero_to_fp32_script_reads_a_deepspeed_checkpoint(tmp_path):
    script = os.path.join(ROOT, "runtime", "train", "checkpoint", "zero_to_fp32.py")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "ds", "s3_bf16"), ckpt)
    proc = subprocess.run([sys.executable, script, str(ckpt), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    sd = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    _equal_state(sd, torch.load(os.path.join(DATA, "fp32", "s3_bf16-ds.pt"), weights_only=True))


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_deepspeed_classes_load_as_stand_ins_but_nothing_else_runs(tmp_path):
    from dslaunch.runtime.checkpoint import CheckpointError
    from dslaunch.runtime.checkpoint.consolidate import consolidate_checkpoint
    from dslaunch.runtime.checkpoint.files import load_torch
    from dslaunch.runtime.checkpoint.foreign import LossScaler, save_with_deepspeed_globals

    optim = os.path.join(DATA, "ds", "s2_fp32", fx.TAG, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    state = load_torch(optim)
    assert isinstance(state["optimizer_state_dict"]["loss_scaler"], LossScaler)
    assert state["optimizer_state_dict"]["zero_stage"] == 2

    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "ds", "s2_fp32"), ckpt)
    marker = tmp_path / "pwned"
    victim = ckpt / fx.TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = load_torch(str(victim))
    state["optimizer_state_dict"]["loss_scaler"] = _RunsACommand(str(marker))
    save_with_deepspeed_globals(state, str(victim))  # every other object as DeepSpeed pickles it
    with pytest.raises(CheckpointError) as info:
        consolidate_checkpoint(str(ckpt))
    assert str(info.value) == (f"checkpoint file {victim} holds pickled Python objects (posix.system) that could run "
                               "code when loaded; refused. If you trust its source, pass trust_pickle=True")
    assert not marker.exists()


def test_deepspeed_tensor_parallel_checkpoint_missing_a_slice_is_one_line(tmp_path, capsys):
    """A checkpoint saying tp_degree 2 without tensor rank 1's file: one line naming it.
    (Whole DeepSpeed AutoTP checkpoints load: tests/runtime/tensor_parallel/test_tp_checkpoint.py.)"""
    from dslaunch.runtime.checkpoint.consolidate import consolidate
    from dslaunch.runtime.checkpoint.files import load_torch
    from dslaunch.runtime.checkpoint.foreign import save_with_deepspeed_globals

    ckpt = tmp_path / "ckpt"
    shutil.copytree(os.path.join(DATA, "ds", "s0_fp32"), ckpt)
    states = ckpt / fx.TAG / "mp_rank_00_model_states.pt"
    model = load_torch(str(states))
    model.update(mp_world_size=2, checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 2})
    save_with_deepspeed_globals(model, str(states))
    with pytest.raises(SystemExit) as info:
        consolidate.main([str(ckpt), str(tmp_path / "out.pt")], prog_name="dslaunch consolidate")
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "mp_rank_01_model_states.pt" in err[0], err
