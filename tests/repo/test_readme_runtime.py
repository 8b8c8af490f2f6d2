"""The runtime example of docs/runtime.md runs as written, bf16 on: with plain python (one process) and
under dslaunch with 2 workers; and float32 inputs to the bf16 model are one line, exit 2."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import repo_paths

ROOT = repo_paths.ROOT


def _snippet() -> str:
    text = (ROOT / "docs" / "runtime.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _run(cmd, cwd, timeout=240):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(400)
def test_readme_runtime_example_runs_as_written(tmp_path):
    code = _snippet()
    assert '"bf16": {"enabled": True}' in code
    script = tmp_path / "train.py"
    script.write_text(code)
    one = _run([sys.executable, str(script)], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "Traceback" not in one.stderr
    assert "dslaunch: ZeRO stage 0 | bf16 compute, fp32 masters" in one.stdout
    assert re.search(r"step 32 \(epoch 0 32/32\) \| loss [\d.]+ \(mean of 8 steps\)", one.stdout), one.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step32"

    two_dir = tmp_path / "two"
    two_dir.mkdir()
    dslaunch = pathlib.Path(sys.executable).with_name("dslaunch")
    two = _run([str(dslaunch), "--num_gpus", "2", str(script)], two_dir)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    assert "world 2 = data 2" in two.stdout and (two_dir / "ckpt" / "latest").read_text() == "global_step32"

    bad = tmp_path / "float_inputs.py"
    bad.write_text(code.replace("engine(x.to(engine.device, dtype))", "engine(x.to(engine.device))"))
    err = _run([sys.executable, str(bad)], tmp_path)
    assert err.returncode == 2
    assert err.stderr.strip().splitlines()[-1].startswith(
        "error: bf16.enabled: the model runs in bfloat16 but engine(...) got float32 inputs; cast them first, "
        "e.g. x.to(engine.device, torch.bfloat16)")
    assert "Traceback" not in err.stderr
