"""Checkpoint atomicity: a save killed halfway leaves the previous checkpoint and `latest`
loadable; a damaged or missing checkpoint is a clear CheckpointError that loads nothing."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from dist_harness import run_function

SAVE_THEN_DIE = r'''
import json, os, signal, sys
import torch
import dslaunch.runtime as deepspeed

save_dir = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
    "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "steps_per_print": 100})
def train(n):
    for _ in range(n):
        engine.backward(engine(torch.ones(4, 4)).pow(2).mean())
        engine.step()
train(2)
engine.save_checkpoint(save_dir, tag="good", client_state={"note": "good"})
print("SAVED " + json.dumps([p.detach().flatten().tolist() for p in model.parameters()]), flush=True)
train(2)

real_save = torch.save
def dying_save(obj, f, *a, **k):
    f.write(b"half a checkpoint")
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
engine.save_checkpoint(save_dir, tag="next")
'''


def load_body(save_dir, expected):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.checkpoint import CheckpointError

    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "steps_per_print": 100})
    out = {}
    path, client = engine.load_checkpoint(save_dir)
    out["latest"] = (os.path.basename(path), client, engine.global_steps)
    out["weights_match"] = [p.detach().flatten().tolist() for p in model.parameters()] == expected

    def snapshot():
        return [p.detach().clone() for p in model.parameters()] + [engine.global_steps]

    errors = {}
    for tag in ("missing", "no_manifest", "truncated", "garbage"):
        before = snapshot()
        try:
            engine.load_checkpoint(save_dir, tag=tag)
            errors[tag] = None
        except CheckpointError as exc:
            errors[tag] = str(exc)
        after = snapshot()
        assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in zip(before, after)), tag
    out["errors"] = errors
    # No `latest`: DeepSpeed's (None, None) and a one-line notice; a named tag that is absent is an error.
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out["no_latest"] = engine.load_checkpoint(os.path.join(save_dir, "nowhere"))
    out["no_latest_notice"] = err.getvalue()
    try:
        engine.load_checkpoint(os.path.join(save_dir, "nowhere"), tag="global_step1")
    except CheckpointError as exc:
        out["absent_tag"] = str(exc)
    out["fp16"] = _fp16_round_trip(os.path.join(save_dir, "fp16"))
    return out


def _fp16_round_trip(save_dir):
    """fp16: fp32 masters, Adam state and the loss scaler survive a round trip bit for bit."""
    import torch

    import dslaunch.runtime as deepspeed

    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "steps_per_print": 100,
           "fp16": {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 3}}

    def make(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

    def train(engine, n):
        losses = []
        for i in range(n):
            x = torch.linspace(-1, 1, 16).view(4, 4).half() * (i + 1)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses

    a = make(0)
    train(a, 4)
    a.save_checkpoint(save_dir)
    b = make(1)
    b.load_checkpoint(save_dir)
    same_masters = all(torch.equal(x, y) for x, y in zip(a.strategy.masters, b.strategy.masters))
    return (same_masters, a.loss_scale() == b.loss_scale(), a.skipped_steps == b.skipped_steps,
            train(a, 3) == train(b, 3), b.module[0].weight.dtype)


@pytest.mark.timeout(120)
def test_killed_save_keeps_previous_checkpoint_and_damage_is_detected(tmp_path):
    save = tmp_path / "ckpt"
    script = tmp_path / "die.py"
    script.write_text(SAVE_THEN_DIE)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), str(save)], capture_output=True, text=True, timeout=100,
                          env=env)
    assert proc.returncode == -9, proc.stderr[-3000:]
    expected = json.loads([l for l in proc.stdout.splitlines() if l.startswith("SAVED ")][0][6:])
    assert (save / "latest").read_text() == "good"
    assert not (save / "next").exists()

    # Damaged copies of the good checkpoint.
    good = save / "good"
    shutil.copytree(good, save / "no_manifest")
    os.remove(save / "no_manifest" / "manifest.json")
    shutil.copytree(good, save / "truncated")
    model_file = save / "truncated" / "mp_rank_00_model_states.pt"
    model_file.write_bytes(model_file.read_bytes()[:100])
    shutil.copytree(good, save / "garbage")
    gfile = save / "garbage" / "mp_rank_00_model_states.pt"
    size = gfile.stat().st_size
    gfile.write_bytes(b"\0" * size)  # right size, unreadable content

    out = run_function(load_body, nprocs=1, kwargs={"save_dir": str(save), "expected": expected}, timeout=100)[0]
    assert out["latest"] == ("good", {"note": "good"}, 2)
    assert out["weights_match"]
    errs = out["errors"]
    assert errs["missing"] == f"checkpoint {save}/missing does not exist"
    assert errs["no_manifest"] == (f"checkpoint {save}/no_manifest is incomplete or damaged: "
                                   "manifest.json is missing or unreadable")
    assert errs["truncated"] == (f"checkpoint {save}/truncated is damaged: "
                                 "mp_rank_00_model_states.pt is missing or has the wrong size")
    assert errs["garbage"] == (f"checkpoint file {save}/garbage/mp_rank_00_model_states.pt is damaged: "
                               "its contents do not match the xxh3_64 checksum in manifest.json")
    import torch

    assert out["fp16"] == (True, True, True, True, torch.float16)
    assert out["no_latest"] == (None, None)
    assert out["no_latest_notice"] == (f"dslaunch: load_checkpoint: no checkpoint in {save}/nowhere "
                                       f"({save}/nowhere/latest does not exist); nothing loaded\n")
    assert out["absent_tag"] == f"checkpoint {save}/nowhere/global_step1 does not exist"


CRASH_AT_EVERY_STEP = r'''
import json, os, shutil, signal, sys
import torch
import dslaunch.runtime as deepspeed
from dslaunch.runtime.checkpoint import saving as save_module
from dslaunch.runtime.checkpoint.layout import read_latest

root = sys.argv[1]
steps = sys.argv[2].split(",")
cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "steps_per_print": 100}

def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]

def train(engine):
    engine.backward(engine(torch.ones(4, 4)).pow(2).mean())
    engine.step()

def weights(engine):
    return [p.detach().clone() for p in engine.module.parameters()]

engine, checker = make(0), make(1)
save = os.path.join(root, "ckpt")
train(engine)
engine.save_checkpoint(save, tag="T")        # the old checkpoint: latest -> T
old = weights(engine)
pristine = os.path.join(root, "pristine")
shutil.copytree(save, pristine)
train(engine)
new = weights(engine)
result = {}
for step in steps:
    shutil.rmtree(save)
    shutil.copytree(pristine, save)
    pid = os.fork()
    if pid == 0:
        def die(name):
            if name == step:
                os.kill(os.getpid(), signal.SIGKILL)
        save_module._crash_hook = die
        engine.save_checkpoint(save, tag="T")  # overwrite the tag latest names
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    path, _ = checker.load_checkpoint(save)  # whatever latest names must load, checksums verified
    got = weights(checker)
    which = "old" if all(torch.equal(a, b) for a, b in zip(got, old)) else \
        "new" if all(torch.equal(a, b) for a, b in zip(got, new)) else "neither"
    result[step] = [killed, read_latest(save), which]
# After a crash, the next save completes and leaves no leftovers.
engine.save_checkpoint(save, tag="T")
result["after"] = sorted(os.listdir(save))
print("RESULT " + json.dumps(result), flush=True)
'''

SAVE_STEPS = ["staging-created", "files-written", "manifest-written", "previous-linked", "latest-to-previous",
              "old-moved-aside", "new-in-place", "latest-updated", "cleaned"]


@pytest.mark.timeout(150)
def test_latest_always_names_a_loadable_checkpoint_when_a_save_is_killed_at_any_step(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_AT_EVERY_STEP)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), ",".join(SAVE_STEPS)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][0][7:])
    expected_latest = {"latest-to-previous": ".old.T", "old-moved-aside": ".old.T", "new-in-place": ".old.T"}
    for i, step in enumerate(SAVE_STEPS):
        killed, latest, which = result[step]
        assert killed, step
        assert latest == expected_latest.get(step, "T"), step
        assert which == ("new" if i >= SAVE_STEPS.index("latest-updated") else "old"), step
    assert result["after"] == ["T", "latest", "zero_to_fp32.py"]
