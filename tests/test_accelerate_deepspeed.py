"""`accelerate launch` with a DeepSpeed plugin, on dslaunch.runtime through the `deepspeed`
compatibility package: a small loop on 2 processes (tests/workers/accelerate_ds_job.py)
whose weights equal a plain-torch reference on the global batch after every step."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "workers", "accelerate_ds_job.py")
TOL = 1e-5


def ds_config(stage: int) -> dict:
    # Accelerate fills the "auto" values: lr/weight decay from DummyOptim, the schedule from
    # DummyScheduler, the micro batch from the prepared DataLoader.
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR",
                          "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                     "total_num_steps": "auto"}},
            "zero_optimization": {"stage": stage}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [3])
def test_accelerate_launch_deepspeed_plugin_two_processes(deepspeed_compat, tmp_path, stage):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(stage)))
    out = tmp_path / "out.json"
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    res = subprocess.run([accelerate, "launch", "--use_deepspeed", "--deepspeed_config_file", str(cfg),
                          "--num_processes", "2", "--num_machines", "1", "--main_process_port", "0",
                          "--mixed_precision", "no", "--dynamo_backend", "no", JOB, str(out)],
                         env=deepspeed_compat.env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["num_processes"] == 2 and got["distributed_type"] == "DistributedType.DEEPSPEED"
    assert got["engine"] == "DeepSpeedEngine" and got["optimizer"] == "AdamW"
    assert len(got["diffs"]) == 4 and max(got["diffs"]) <= TOL, got
    assert got["lr"] == [0.0]  # WarmupDecayLR ran to its total_num_steps
