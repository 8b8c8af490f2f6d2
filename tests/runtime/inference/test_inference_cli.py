"""The seed's inference examples as a user runs them: `dslaunch --num_gpus 2 inference.py` with a
Hugging Face pipeline's model (GPT-Neo, replace_with_kernel_inject=True) and T5 with the seed's
injection_policy, against the same script as one process; and bad arguments, each one line on
stderr and exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import repo_paths

pytest.importorskip("transformers", reason="the [hf] extra (scripts/setup_env.sh installs it)")

HERE = str(repo_paths.TESTS)
SCRIPT = os.path.join(HERE, "workers", "inference_seed.py")
DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher.main"]


def _run(argv, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


def _outputs(stdout):
    rows = [json.loads(line[line.index("{"):]) for line in stdout.splitlines() if '{"rank"' in line]
    return {r["rank"]: r["text"] for r in rows}


def test_seed_examples_under_dslaunch_match_one_process():
    single = _run([sys.executable, SCRIPT, "gpt_neo,t5"])
    assert single.returncode == 0, single.stderr[-3000:]
    two = _run(DSLAUNCH + ["--master_port", "0", "--num_gpus", "2", SCRIPT, "gpt_neo,t5"])
    assert two.returncode == 0, two.stderr[-3000:]
    ranks = _outputs(two.stdout)
    expected = _outputs(single.stdout)[0]
    assert ranks == {0: expected, 1: expected}  # sampled and greedy text: every rank, as one process
    assert "tp 2 (all ranks)" in two.stderr
    assert "replace_with_kernel_inject: nothing replaced (GPTNeoForCausalLM accepts no attention backend" \
        in two.stderr  # never silently ignored
    assert "tensor parallel x2 (injection_policy)" in two.stderr


@pytest.mark.parametrize("case,launcher,message", [
    ("bad_dtype", "python", "error: init_inference: dtype torch.int16 is not supported; use torch.float, "
                            "torch.half, torch.bfloat16 or torch.int8"),
    ("bad_world", "python", "error: init_inference: tp_size=3 does not divide the world size 1"),
    ("bad_policy", "python", "error: injection_policy[GPTNeoBlock]: no module named 'mlp.c_projj' in GPTNeoBlock; "
                             "did you mean 'mlp.c_proj'?"),
    ("bad_heads", "dslaunch", "error: tensor parallel: tp size 2 does not divide the 3 heads that "
                              "transformer.h.0.attn.attention.k_proj projects to (GPTNeoSelfAttention)"),
])
def test_bad_arguments_are_one_line_and_exit_2(case, launcher, message):
    argv = [sys.executable, SCRIPT, case] if launcher == "python" else \
        DSLAUNCH + ["--master_port", "0", "--num_gpus", "2", SCRIPT, case]
    run = _run(argv)
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if "error:" in line]
    assert lines and all(line.endswith(message) for line in lines), run.stderr[-3000:]
