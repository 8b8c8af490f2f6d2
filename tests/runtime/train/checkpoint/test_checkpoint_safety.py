"""Checkpoints under attack and bad luck (issue #9 items 1, 3, 4, 6), through the public API:
- a crafted checkpoint whose client_state runs a command when unpickled: nothing runs, one line,
  in load_checkpoint and in `dslaunch consolidate`;
- client_state that would need pickle is refused at save (one line naming the key) unless
  allow_pickle=True, and then loads only with trust_pickle=True;
- 64 bytes overwritten inside a shard: refused, naming the file;
- ZeRO-3 loading into another model (extra layer, other shape, missing parameters): one line;
- a full disk and an unwritable directory: one line naming the path and the OS error, no
  temporary files left, the previous checkpoint intact, the directory checked before any
  state is gathered.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dist_harness import run_function
import repo_paths

CFG = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "steps_per_print": 100}


def _engine(stage=0, widths=(4, 8, 1), seed=0):
    import dslaunch.runtime as deepspeed

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = torch.nn.Sequential(*layers)
    cfg = dict(CFG, zero_optimization={"stage": stage})
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]


def _train(engine, n=2):
    for _ in range(n):
        engine.backward(engine(torch.ones(4, engine.module[0].in_features)).pow(2).mean())
        engine.step()


class _RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _resign(tag_dir, name):
    """What an attacker does after editing a file: recompute its manifest entry."""
    import json

    from dslaunch.runtime.checkpoint.files import file_record

    mpath = os.path.join(tag_dir, "manifest.json")
    with open(mpath) as fh:
        m = json.load(fh)
    rec = file_record(os.path.join(tag_dir, name))
    m["files"][name] = {"size": rec.size, "digest": rec.digest}
    with open(mpath, "w") as fh:
        json.dump(m, fh)


def _error(fn, *args, **kwargs):
    from dslaunch.runtime.checkpoint import CheckpointError

    try:
        fn(*args, **kwargs)
    except CheckpointError as exc:
        return str(exc)
    return None


def safety_body(root):
    import argparse

    out = {}
    engine = _engine(stage=1)  # stage 1 on one rank: a sharded optimizer file to damage
    _train(engine)
    save = os.path.join(root, "ckpt")
    engine.save_checkpoint(save, tag="good", client_state={"step": 2, "t": torch.arange(3), "names": ["a"]})

    # Item 1: a crafted model file (manifest re-signed) runs nothing and is one line.
    marker = os.path.join(root, "pwned")
    import shutil

    shutil.copytree(os.path.join(save, "good"), os.path.join(save, "evil"))
    name = "mp_rank_00_model_states.pt"
    state = torch.load(os.path.join(save, "good", name), weights_only=True)
    state["client_state"] = {"x": _RunsACommand(marker)}
    torch.save(state, os.path.join(save, "evil", name))
    _resign(os.path.join(save, "evil"), name)
    out["evil_load"] = _error(engine.load_checkpoint, save, tag="evil")
    out["evil_ran"] = os.path.exists(marker)

    # client_state that needs pickle: refused at save, naming the key ...
    out["refused"] = _error(engine.save_checkpoint, save, tag="ns", client_state={"args": argparse.Namespace(lr=1)})
    out["refused_left"] = sorted(os.listdir(save))
    # ... or saved with the opt-in, and then loaded only with trust_pickle=True
    engine.save_checkpoint(save, tag="ns", client_state={"args": argparse.Namespace(lr=1)}, allow_pickle=True)
    out["ns_untrusted"] = _error(engine.load_checkpoint, save, tag="ns")
    _, client = engine.load_checkpoint(save, tag="ns", trust_pickle=True)
    out["ns_trusted"] = vars(client["args"])

    _, client = engine.load_checkpoint(save, tag="good")
    out["good_client"] = (client["step"], client["t"].tolist(), client["names"])

    # Item 3: 64 bytes overwritten inside the optimizer shard (inside tensor data) is refused.
    shutil.copytree(os.path.join(save, "good"), os.path.join(save, "flipped"))
    shard = os.path.join(save, "flipped", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(b"\x7f" * 64)
    before = [p.detach().clone() for p in engine.module.parameters()]
    out["flipped"] = _error(engine.load_checkpoint, save, tag="flipped")
    out["flipped_untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))

    # Tags: refused before anything is written.
    out["bad_tag"] = _error(engine.save_checkpoint, save, tag="../x")
    out["bad_load_tag"] = _error(engine.load_checkpoint, save, tag="latest")
    return out


@pytest.mark.timeout(180)
def test_crafted_pickle_runs_nothing_and_damage_is_one_line(tmp_path, capsys):
    out = run_function(safety_body, nprocs=1, kwargs={"root": str(tmp_path)}, timeout=150)[0]
    save = tmp_path / "ckpt"
    assert out["evil_ran"] is False and not (tmp_path / "pwned").exists()
    assert out["evil_load"] == (f"checkpoint file {save}/evil/mp_rank_00_model_states.pt holds pickled Python "
                                "objects (posix.system) that could run code when loaded; refused. If you trust its "
                                "source, pass trust_pickle=True")
    assert out["refused"] == ("save_checkpoint: client_state['args']: argparse.Namespace is not a tensor, number, "
                              "string or container of those; store tensors and JSON-like values (they load with "
                              "weights_only=True), or pass allow_pickle=True")
    assert out["refused_left"] == ["evil", "good", "latest", "zero_to_fp32.py"]
    assert out["ns_untrusted"] == (f"checkpoint {save}/ns: its client_state was saved with allow_pickle=True and "
                                   "needs pickle to load; pass trust_pickle=True if you trust its source")
    assert out["ns_trusted"] == {"lr": 1}
    assert out["good_client"] == (2, [0, 1, 2], ["a"])
    assert out["flipped"] == (f"checkpoint file {save}/flipped/zero_pp_rank_0_mp_rank_00_optim_states.pt is damaged:"
                              " its contents do not match the xxh3_64 checksum in manifest.json")
    assert out["flipped_untouched"]
    assert out["bad_tag"] == "checkpoint save_checkpoint tag '../x' contains a path separator"
    assert out["bad_load_tag"] == "checkpoint load_checkpoint tag 'latest' is reserved (the latest file lives beside the tags)"

    # `dslaunch consolidate` on the crafted and the damaged checkpoints: one line, exit 2, nothing run.
    from dslaunch.runtime.checkpoint.consolidate import consolidate

    for tag, expect in (("evil", "holds pickled Python objects (posix.system)"),
                        ("flipped", "do not match the xxh3_64 checksum")):
        with pytest.raises(SystemExit) as info:
            consolidate.main(args=[str(save), str(tmp_path / "o.pt"), "--tag", tag], prog_name="dslaunch consolidate")
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2 and len(err) == 1 and expect in err[0], err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "o.pt").exists()


def zero3_mismatch_body(root):
    save = os.path.join(root, "z3")
    engine = _engine(stage=3, widths=(4, 8, 1))
    _train(engine)
    engine.save_checkpoint(save, tag="t")
    out = {}
    for label, widths in (("extra", (4, 8, 8, 1)), ("shape", (4, 6, 1)), ("missing", (4, 1))):
        other = _engine(stage=3, widths=widths, seed=1)
        before = [p._zero.shard.clone() for p in other.module.parameters()]
        out[label] = _error(other.load_checkpoint, save, tag="t")
        out[label + "_untouched"] = all(torch.equal(a, p._zero.shard) for a, p in zip(before, other.module.parameters()))
    same = _engine(stage=3, widths=(4, 8, 1), seed=2)
    same.load_checkpoint(save, tag="t")
    out["same"] = [torch.equal(p._zero.shard, q._zero.shard)
                   for p, q in zip(same.module.parameters(), engine.module.parameters())]
    return out


UNCAUGHT = textwrap.dedent('''
    import sys, torch
    import dslaunch.runtime as deepspeed
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 1))
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3}})[0]
    engine.load_checkpoint(sys.argv[1], tag="t")
''')


@pytest.mark.timeout(180)
def test_zero3_checks_the_model_like_stages_0_to_2(tmp_path):
    out = run_function(zero3_mismatch_body, nprocs=1, kwargs={"root": str(tmp_path)}, timeout=150)[0]
    path = f"{tmp_path}/z3/t"
    assert out["extra"] == f"checkpoint {path} does not match the model: missing ['2.weight', '2.bias'], unexpected []"
    assert out["shape"] == f"checkpoint {path}: 0.weight has shape (8, 4), the model has (6, 4)"
    assert out["missing"] == (f"checkpoint {path} does not match the model: missing [], "
                              "unexpected ['1.weight', '1.bias']")
    assert all(out[k + "_untouched"] for k in ("extra", "shape", "missing"))
    assert all(out["same"])

    # Uncaught in a script: one line and exit 2, not a 49-line RuntimeError.
    script = tmp_path / "load.py"
    script.write_text(UNCAUGHT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), f"{tmp_path}/z3"], capture_output=True, text=True, env=env,
                          timeout=120)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert proc.returncode == 2 and lines == [f"error: checkpoint {path}: 0.weight has shape (8, 4), the model has "
                                              "(6, 4)"], proc.stderr


def disk_body(full, readonly, not_dir):
    out = {}
    engine = _engine(stage=0)
    _train(engine)
    save = os.path.join(full, "ckpt")
    engine.save_checkpoint(save, tag="a")
    before = [p.detach().clone() for p in engine.module.parameters()]
    # A save that does not fit: one line, naming the file and the OS error; nothing left behind.
    out["full"] = _error(engine.save_checkpoint, save, tag="b", client_state={"big": torch.zeros(400_000)})
    out["full_left"] = sorted(os.listdir(save)) + sorted(os.listdir(os.path.join(save, "a")))
    engine.load_checkpoint(save)
    out["previous_intact"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))

    # Unwritable directories are found before any state is gathered.
    gathered = []
    real = engine.strategy.module_state_dict
    engine.strategy.module_state_dict = lambda: gathered.append(1) or real()
    out["readonly"] = _error(engine.save_checkpoint, os.path.join(readonly, "ckpt"))
    out["not_dir"] = _error(engine.save_checkpoint, os.path.join(not_dir, "ckpt"))
    out["gathered"] = len(gathered)
    return out


def _mount(path, opts):
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {proc.stderr.strip()}")


@pytest.mark.timeout(180)
def test_full_disk_and_unwritable_directory_are_one_line(tmp_path):
    full, readonly = tmp_path / "full", tmp_path / "ro"
    _mount(full, "size=1m")
    try:
        _mount(readonly, "ro,size=64k")
        try:
            (tmp_path / "file").write_text("x")
            out = run_function(disk_body, nprocs=1, timeout=150, kwargs={
                "full": str(full), "readonly": str(readonly), "not_dir": str(tmp_path / "file")})[0]
        finally:
            subprocess.run(["umount", str(readonly)])
    finally:
        subprocess.run(["umount", str(full)])
    assert out["full"] == f"cannot write {full}/ckpt/.tmp.b/mp_rank_00_model_states.pt: No space left on device"
    assert out["full_left"] == ["a", "latest", "zero_to_fp32.py", "manifest.json", "mp_rank_00_model_states.pt",
                                "rng_state_rank_0.pt"]
    assert out["previous_intact"]
    assert out["readonly"] == f"cannot create checkpoint directory {readonly}/ckpt: Read-only file system"
    assert out["not_dir"] == f"cannot create checkpoint directory {tmp_path}/file/ckpt: Not a directory"
    assert out["gathered"] == 0


DS_S1 = os.path.join(repo_paths.DATA, "ds_interop", "ds", "s1_fp32")


def test_garbage_in_a_deepspeed_shard_is_damage_not_a_pickle_threat(tmp_path, capsys):
    """64 bytes overwritten in the pickle of a DeepSpeed-layout shard (no manifest, so no
    checksum) are not a payload: the line says the file is damaged and does not send the user
    to trust_pickle; a real payload in the same file is still named as one."""
    import shutil

    from dslaunch.runtime.checkpoint.consolidate import consolidate

    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copytree(DS_S1, tmp_path / "garbage")
    shard = tmp_path / "garbage" / "global_step3" / name
    with open(shard, "r+b") as fh:
        fh.seek(int(os.path.getsize(shard) * 0.3))  # inside data.pkl
        fh.write(b"\x7f" * 64)
    shutil.copytree(DS_S1, tmp_path / "payload")
    marker = tmp_path / "pwned"
    evil = tmp_path / "payload" / "global_step3" / name
    from dslaunch.runtime.checkpoint.files import load_torch
    from dslaunch.runtime.checkpoint.foreign import save_with_deepspeed_globals

    state = load_torch(str(evil))  # DeepSpeed's pickled classes come back as stand-ins ...
    state["x"] = _RunsACommand(marker)
    with open(evil, "wb") as fh:
        save_with_deepspeed_globals(state, fh)  # ... and go back under DeepSpeed's names
    lines = {}
    for how in ("garbage", "payload"):
        with pytest.raises(SystemExit) as info:
            consolidate.main(args=[str(tmp_path / how), str(tmp_path / "o.pt")], prog_name="dslaunch consolidate")
        lines[how] = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2 and len(lines[how]) == 1, lines[how]
    path = tmp_path / "garbage" / "global_step3" / name
    assert lines["garbage"][0] == (f"dslaunch consolidate: checkpoint file {path} is damaged or truncated: its pickled "
                                   "data is not valid (Unsupported operand 127); restore the file from a good copy")
    assert "trust_pickle" not in lines["garbage"][0]
    assert "holds pickled Python objects (posix.system) that could run code" in lines["payload"][0]
    assert not marker.exists() and not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("case, states", [("s2_fp32", "mp_rank_00_model_states.pt"),
                                          ("s3_fp32", "zero_pp_rank_0_mp_rank_00_model_states.pt")])
@pytest.mark.parametrize("shape, why", [
    ((-3, 15), "inp.weight has shape (-3, 15): a dimension below 0"),
    ((2 ** 28, 5), "inp.weight has shape (268435456, 5)"),
    ((9, 2 ** 28), "inp.weight has shape (9, 268435456)"),
    (("nine", 5), "inp.weight has shape ('nine', 5): not a list of whole numbers"),
    ((9.5, 5), "inp.weight has shape (9.5, 5): not a list of whole numbers"),
])
@pytest.mark.timeout(120)
def test_crafted_param_shapes_are_refused_before_anything_is_allocated(tmp_path, capsys, case, states, shape, why):
    """param_shapes decides how much is allocated for each parameter: a negative or huge
    dimension gave RuntimeError tracebacks, after allocating the declared size (1.29 GB).
    The shapes are now checked against the elements the shard files really hold first."""
    import shutil

    from dslaunch.runtime.checkpoint.consolidate import consolidate
    from dslaunch.runtime.checkpoint.files import load_torch
    from dslaunch.runtime.checkpoint.foreign import save_with_deepspeed_globals

    ck = tmp_path / "ck"
    shutil.copytree(os.path.join(os.path.dirname(DS_S1), case), ck)
    for f in sorted((ck / "global_step3").glob("*model_states.pt")):
        model = load_torch(str(f))
        model["param_shapes"][0]["inp.weight"] = shape
        with open(f, "wb") as fh:
            save_with_deepspeed_globals(model, fh)
    with pytest.raises(SystemExit) as info:
        consolidate.main(args=[str(ck), str(tmp_path / "o.pt")], prog_name="dslaunch consolidate")
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"dslaunch consolidate: checkpoint {ck}/global_step3: param_shapes: ")
    assert why in lines[0]
    assert not (tmp_path / "o.pt").exists()
