"""scripts/train_gpt.py with its own JSON config on 2 gloo ranks under `dslaunch` (the
README's demo command): trains, the loss falls, and a checkpoint it writes resumes in a
fresh pair of processes."""
import os
import re
import subprocess
import sys

import pytest

from dist_harness import run_script
import repo_paths

ROOT = str(repo_paths.ROOT)
SCRIPT = os.path.join(ROOT, "scripts", "train_gpt.py")


@pytest.mark.timeout(200)
def test_train_gpt_two_ranks_loss_falls_and_resumes(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    dslaunch = os.path.join(os.path.dirname(sys.executable), "dslaunch")
    run = subprocess.run([dslaunch, "--num_gpus", "2", "--master_port", "0", SCRIPT, "--steps", "12",
                          "--checkpoint_dir", ckpt], capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = "\n".join(l[len("[rank 0] "):] for l in run.stdout.splitlines() if l.startswith("[rank 0] "))
    assert "2 processes, batch 32 (micro 16 x accumulation 1), ZeRO stage 0" in out
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    assert last < first - 0.8, out  # from ~ln(256)=5.5 towards character statistics
    resumed = run_script([SCRIPT, "--steps", "13", "--checkpoint_dir", ckpt, "--resume"], nprocs=2, timeout=100)
    assert resumed[0].returncode == 0, resumed[0].stderr[-3000:]
    assert "done: 13 steps" in resumed[0].stdout
    assert open(os.path.join(ckpt, "latest")).read() == "global_step13"
