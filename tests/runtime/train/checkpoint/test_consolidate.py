"""`dslaunch consolidate`: bad input is one line and exit 2; stage-0 checkpoints work too
(the ZeRO paths are exercised in test_zero_engine.py and test_zero_checkpoint.py)."""
import os
import subprocess
import sys

import pytest
import torch

from dslaunch.runtime.consolidate import consolidate_checkpoint

DSLAUNCH = os.path.join(os.path.dirname(sys.executable), "dslaunch")


def _run(*args):
    return subprocess.run([DSLAUNCH, "consolidate", *args], capture_output=True, text=True)


def _run_in_process(capsys, *args):
    """The click command itself, without paying a torch import per case."""
    from dslaunch.runtime.consolidate import consolidate

    with pytest.raises(SystemExit) as info:
        consolidate.main(args=list(args), prog_name="dslaunch consolidate")
    return info.value.code, capsys.readouterr().err


def _fake_stage0_checkpoint(root):
    """A stage-0 checkpoint as save_checkpoint lays it out, without an engine."""
    from dslaunch.runtime.checkpoint.files import write_torch
    from dslaunch.runtime.checkpoint.manifest import Manifest

    tag = root / "global_step3"
    tag.mkdir(parents=True)
    lin = torch.nn.Linear(3, 5).to(torch.bfloat16)
    name = "mp_rank_00_model_states.pt"
    rec = write_torch(str(tag / name), {"module": lin.state_dict(), "optimizer": None, "dp_world_size": 2,
                                        "dslaunch": {}})
    manifest = Manifest(tag="global_step3", world_size=2, zero_stage=0, sharded_optimizer_state=False,
                        files={name: rec})
    (tag / "manifest.json").write_text(manifest.to_json())
    (root / "latest").write_text("global_step3")
    return lin


def test_stage0_checkpoint_consolidates_to_fp32(tmp_path):
    lin = _fake_stage0_checkpoint(tmp_path / "ck")
    out = tmp_path / "out" / "model.pt"
    proc = _run(str(tmp_path / "ck"), str(out))
    assert proc.returncode == 0, proc.stderr
    sd = torch.load(out)
    assert set(sd) == {"weight", "bias"} and all(v.dtype == torch.float32 for v in sd.values())
    assert torch.equal(sd["weight"], lin.weight.float())


@pytest.mark.parametrize("setup,args,message", [
    ("none", ["{d}/nope", "{d}/o.pt"], "nope: not a directory"),
    ("empty", ["{d}/ck", "{d}/o.pt"], "latest: missing; pass --tag"),
    ("ckpt", ["{d}/ck", "{d}/o.pt", "--tag", "global_step9"], "global_step9: no such checkpoint tag"),
    ("broken", ["{d}/ck", "{d}/o.pt"], "is incomplete or damaged: manifest.json is missing or unreadable"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, args, message):
    if setup == "empty":
        (tmp_path / "ck").mkdir()
    elif setup == "ckpt":
        _fake_stage0_checkpoint(tmp_path / "ck")
    elif setup == "broken":
        _fake_stage0_checkpoint(tmp_path / "ck")
        os.remove(tmp_path / "ck" / "global_step3" / "manifest.json")
    code, err = _run_in_process(capsys, *[a.format(d=tmp_path) for a in args])
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dslaunch consolidate: ") and message in lines[0], err


def test_safetensors_output_needs_the_package(tmp_path, capsys):
    _fake_stage0_checkpoint(tmp_path / "ck")
    code, err = _run_in_process(capsys, str(tmp_path / "ck"), str(tmp_path / "o.safetensors"))
    try:
        from safetensors.torch import load_file
    except ImportError:
        assert code == 2 and "safetensors package is not installed" in err
    else:
        assert code in (0, None) and set(load_file(str(tmp_path / "o.safetensors"))) == {"weight", "bias"}
    assert not (tmp_path / "o.safetensors.tmp").exists()


def test_function_api_matches_cli(tmp_path):
    lin = _fake_stage0_checkpoint(tmp_path / "ck")
    sd = consolidate_checkpoint(str(tmp_path / "ck"), "global_step3")
    assert torch.equal(sd["bias"], lin.bias.float())


def test_consolidate_help_says_how_the_output_format_is_chosen():
    from click.testing import CliRunner

    from dslaunch.runtime.checkpoint.consolidate import consolidate

    text = " ".join(CliRunner().invoke(consolidate, ["--help"], terminal_width=400).output.split())
    assert "OUT's name picks the format: *.safetensors is written with the safetensors package (an error if " \
           "it is not installed), any other name with torch.save." in text
    assert "otherwise torch format" not in text


@pytest.mark.parametrize("ckpt, out", [
    ("ck", "ck/global_step3/mp_rank_00_model_states.pt"),  # the very file being read
    ("ck", "ck/latest"),
    ("ck", "ck/global_step3/manifest.json"),
    ("ck", "ck/model.pt"),  # a new name among the checkpoint's own files
    ("ck/global_step3", "ck/global_step3/mp_rank_00_model_states.pt"),  # the tag folder given itself
    ("ck", "ck/global_step3/../latest"),
    ("ck", "link/latest"),  # link -> ck: resolved, it is the same file
])
def test_an_output_inside_the_checkpoint_is_refused_and_the_checkpoint_survives(tmp_path, capsys, ckpt, out):
    _fake_stage0_checkpoint(tmp_path / "ck")
    (tmp_path / "link").symlink_to(tmp_path / "ck")
    before = {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    code, err = _run_in_process(capsys, str(tmp_path / ckpt), str(tmp_path / out))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == (f"dslaunch consolidate: {tmp_path / out} is inside the checkpoint {tmp_path / ckpt} being "
                        "read, and writing it there could destroy that checkpoint; write it outside")
    assert {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()} == before
    assert consolidate_checkpoint(str(tmp_path / "ck"))  # still loads


@pytest.mark.parametrize("kind, message", [
    ("fifo", "latest: the file naming the latest tag is a FIFO, not a regular file; refusing to read it"),
    ("device", "latest: the file naming the latest tag is a character device, not a regular file"),
    ("huge", "latest: the file naming the latest tag is 4097 bytes, over its limit of 4 KiB"),
])
@pytest.mark.timeout(60)
def test_a_latest_that_is_no_regular_file_is_one_line(tmp_path, capsys, kind, message):
    """A FIFO named `latest` hung the reader: it is refused by name instead."""
    _fake_stage0_checkpoint(tmp_path / "ck")
    latest = tmp_path / "ck" / "latest"
    latest.unlink()
    if kind == "fifo":
        os.mkfifo(latest)
    elif kind == "device":
        latest.symlink_to("/dev/zero")
    else:
        latest.write_text("g" * 4097)
    code, err = _run_in_process(capsys, str(tmp_path / "ck"), str(tmp_path / "o.pt"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "o.pt").exists()
