"""DeepSpeed's zero_to_fp32 API on dslaunch (issue #14 section 2): the functions a script
imports from `deepspeed.utils.zero_to_fp32` exist under that name (compat package) and as
`dslaunch.runtime.utils.zero_to_fp32`, and give what DeepSpeed's give on the fixtures
DeepSpeed 0.19.8 wrote (scripts/make_ds_fixtures.py); the checkpoint code imports without
xxhash and says in one line when a checksum needs it."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
DATA = os.path.join(ROOT, "tests", "data", "ds_interop")


def _fp32(case, who):
    return torch.load(os.path.join(DATA, "fp32", f"{case}-{who}.pt"), weights_only=True)


def _equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == torch.float32 and torch.equal(a[k], b[k].float()), k


@pytest.mark.parametrize("case", ["s2_bf16", "s3_fp32"])
def test_functions_give_what_deepspeeds_give(tmp_path, case):
    from dslaunch.runtime.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict, convert_zero_checkpoint_to_state_dict,
        get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint,
    )

    for who in ("ds", "dslaunch"):
        ckpt = os.path.join(DATA, who, case)
        ref = _fp32(case, who)  # DeepSpeed's get_fp32_state_dict_from_zero_checkpoint of it
        _equal(get_fp32_state_dict_from_zero_checkpoint(ckpt), ref)
        _equal(get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="global_step3", exclude_frozen_parameters=True,
                                                        lazy_mode=True), ref)

        out = tmp_path / who / "whole"
        assert convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(out)) == [str(out / "pytorch_model.bin")]
        _equal(torch.load(out / "pytorch_model.bin", weights_only=True), ref)
        # DeepSpeed 0.19's dtype form: the same weights rounded to bf16
        out = tmp_path / who / "bf16"
        convert_zero_checkpoint_to_state_dict(ckpt, str(out), dtype="bfloat16")
        half = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert {k: v.dtype for k, v in half.items()} == {k: torch.bfloat16 for k in ref}
        assert all(torch.equal(half[k], ref[k].to(torch.bfloat16)) for k in ref)

        # over max_shard_size: numbered shards and Hugging Face's index, as DeepSpeed writes them
        out = tmp_path / who / "sharded"
        written = convert_zero_checkpoint_to_fp32_state_dict(ckpt, str(out), max_shard_size="200B")
        index = json.loads((out / "pytorch_model.bin.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
        assert sorted(os.path.basename(p) for p in written) == files + ["pytorch_model.bin.index.json"]
        merged = {}
        for name in files:
            merged.update(torch.load(out / name, weights_only=True))
        _equal(merged, ref)
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in ref.values())

        fx = load_script("make_ds_fixtures")
        model = load_state_dict_from_zero_checkpoint(fx.make_model(), ckpt)
        _equal({k: v.detach() for k, v in model.state_dict().items()}, ref)


def test_shipped_script_takes_deepspeeds_arguments_and_bad_input_is_one_line(tmp_path):
    script = os.path.join(ROOT, "runtime", "train", "checkpoint", "zero_to_fp32.py")
    ckpt = os.path.join(DATA, "dslaunch", "s2_fp32")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, script, ckpt, str(out), "-t", "global_step3", "--max_shard_size", "1GB",
                           "--exclude_frozen_parameters", "-d"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _equal(torch.load(out / "pytorch_model.bin", weights_only=True), _fp32("s2_fp32", "dslaunch"))
    proc = subprocess.run([sys.executable, script, ckpt, str(out), "-t", "global_step9"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"zero_to_fp32.py: {ckpt}/global_step9: no such checkpoint tag"]


PROBE = textwrap.dedent('''
    import json, sys
    import deepspeed.utils.zero_to_fp32 as ds_z
    from deepspeed.utils.zero_to_fp32 import (get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint, convert_zero_checkpoint_to_fp32_state_dict)
    import dslaunch.runtime.checkpoint.zero_to_fp32 as ours
    sd = get_fp32_state_dict_from_zero_checkpoint(sys.argv[1])
    print(json.dumps({"same": [ds_z is ours, get_fp32_state_dict_from_zero_checkpoint is
                               ours.get_fp32_state_dict_from_zero_checkpoint,
                               load_state_dict_from_zero_checkpoint is ours.load_state_dict_from_zero_checkpoint,
                               convert_zero_checkpoint_to_fp32_state_dict is
                               ours.convert_zero_checkpoint_to_fp32_state_dict],
                      "keys": sorted(sd)}))
''')


def test_deepspeed_utils_zero_to_fp32_is_ours_under_the_compat_package(deepspeed_compat):
    res = subprocess.run([sys.executable, "-c", PROBE, os.path.join(DATA, "ds", "s3_bf16")],
                         env=deepspeed_compat.env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["same"] == [True, True, True, True]
    assert out["keys"] == sorted(_fp32("s3_bf16", "ds"))


NO_XXHASH = textwrap.dedent('''
    import sys
    sys.modules["xxhash"] = None  # as on an image without the package: `import xxhash` fails
    import dslaunch.runtime
    from dslaunch.runtime.checkpoint.zero_to_fp32 import main
    print("rc", main([sys.argv[1], sys.argv[3]]), main([sys.argv[2], sys.argv[3]]))
''')


def test_runtime_imports_without_xxhash_and_a_checksum_says_it_needs_it(tmp_path):
    ds, ours = os.path.join(DATA, "ds", "s2_fp32"), os.path.join(DATA, "dslaunch", "s2_fp32")
    res = subprocess.run([sys.executable, "-c", NO_XXHASH, ds, ours, str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    # DeepSpeed's checkpoint has no manifest, so nothing to verify; ours needs the checksum
    assert res.stdout.splitlines()[-1] == "rc 0 2"
    assert res.stderr.strip().splitlines() == [
        "zero_to_fp32.py: checkpoint checksums (xxh3_64) need the xxhash package, which is not installed here: "
        "pip install 'xxhash>=3.0' (a declared dependency of dslaunch)"]


def frozen_body(save_dir):
    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    model[0].weight.requires_grad_(False)
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config={"train_batch_size": 2, "zero_optimization": {"stage": 2},
                                          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})[0]
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(save_dir)
    return {k: v.tolist() for k, v in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_exclude_frozen_parameters_leaves_out_what_was_frozen(tmp_path):
    from dist_harness import run_function
    from dslaunch.runtime.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    saved = run_function(frozen_body, nprocs=1, timeout=240, kwargs={"save_dir": str(tmp_path)})[0]
    whole = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    assert sorted(whole) == sorted(saved) and whole["0.weight"].tolist() == saved["0.weight"]
    trainable = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    assert sorted(trainable) == ["0.bias", "1.bias", "1.weight"]


def test_get_optim_files_lists_a_tag_folder_in_rank_order(tmp_path):
    from dslaunch.runtime.checkpoint.zero_to_fp32 import get_model_state_files, get_optim_files

    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(12)]
    for name in reversed(names):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    # rank 10 after rank 9 (DeepSpeed 0.19.8's get_optim_files gives this order: natural keys)
    assert get_optim_files(str(tmp_path)) == [str(tmp_path / n) for n in names]
    assert get_model_state_files(str(tmp_path)) == [str(tmp_path / "mp_rank_00_model_states.pt")]
    with pytest.raises(FileNotFoundError, match=r"no \*_optim_states.pt files in "):
        get_optim_files(str(tmp_path / "missing"))


def test_recovery_script_made_executable_or_logged_where_a_share_refuses(tmp_path, caplog):
    import logging
    import stat

    from dslaunch.runtime.checkpoint.saving import make_executable

    script = tmp_path / "zero_to_fp32.py"
    script.write_text("")
    script.chmod(0o644)
    make_executable(str(script))
    assert stat.S_IMODE(script.stat().st_mode) == 0o755
    # a share that refuses chmod (here: no such file) costs the bit, not the save
    with caplog.at_level(logging.INFO, logger="dslaunch.runtime"):
        make_executable(str(tmp_path / "gone" / "zero_to_fp32.py"))
    assert "could not make" in caplog.text and "python zero_to_fp32.py" in caplog.text
