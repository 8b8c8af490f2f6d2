"""`accelerate launch` with a DeepSpeed plugin, on dslaunch.runtime through the `deepspeed`
compatibility package: a small loop on 2 processes (tests/workers/accelerate_ds_job.py)
whose weights (accelerator.get_state_dict) equal a plain-torch reference on the global batch
after every step, and whose accelerator.save_state / load_state replays to the same weights;
on one machine (ZeRO-3, every weight sharded; optimizer and schedule from the config) and on
two hosts of the test bed (ZeRO-2 with CPU offload; the script's torch AdamW, which Accelerate
turns into deepspeed.ops.adam.DeepSpeedCPUAdam)."""
import json
import os
import subprocess
import sys

import pytest
import repo_paths

HERE = str(repo_paths.TESTS)
JOB = os.path.join(HERE, "workers", "accelerate_ds_job.py")
TOL = 1e-5


def ds_config(stage: int) -> dict:
    # Accelerate fills the "auto" values: lr/weight decay from DummyOptim, the schedule from
    # DummyScheduler, the micro batch from the prepared DataLoader.
    zero = {"stage": stage}
    if stage == 3:  # every weight a shard at rest; accelerator.get_state_dict gathers them
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True})
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupDecayLR",
                          "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
                                     "total_num_steps": "auto"}},
            "zero_optimization": zero}


def _check(out_dir, sharded: bool):
    got = json.loads((out_dir / "out.json").read_text())
    assert got["num_processes"] == 2 and got["distributed_type"] == "DistributedType.DEEPSPEED"
    assert got["engine"] == "DeepSpeedEngine"
    assert len(got["diffs"]) == 4 and max(got["diffs"]) <= TOL, got
    assert got["replay_diff"] <= TOL  # save_state after step 2, load_state, steps 3-4 again: the same weights
    assert bool(got["sharded"]) == sharded
    return got


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [3])
def test_accelerate_launch_deepspeed_plugin_two_processes(deepspeed_compat, tmp_path, stage):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(ds_config(stage)))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    res = subprocess.run([accelerate, "launch", "--use_deepspeed", "--deepspeed_config_file", str(cfg),
                          "--num_processes", "2", "--num_machines", "1", "--main_process_port", "0",
                          "--mixed_precision", "no", "--dynamo_backend", "no", JOB, str(tmp_path)],
                         env=deepspeed_compat.env(), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    got = _check(tmp_path, sharded=stage == 3)
    assert got["optimizer"] == "FusedAdam"  # the config's AdamW, DeepSpeed's class for CPU parameters (not the script's)
    # WarmupDecayLR (warmup 2 of total 4) after 4 steps stands at DeepSpeed's iteration 3:
    # lr = LR * (4 - 3) / (4 - 2), the lr the next step would use
    assert got["lr"] == [pytest.approx(0.01 * 0.5)]


@pytest.mark.testbed
@pytest.mark.timeout(420)
def test_accelerate_multinode_deepspeed_launch_over_the_testbed(ns_cluster, ssh_home, deepspeed_compat, tmp_path):
    """`accelerate launch --num_machines 2` with a DeepSpeed plugin runs `deepspeed --hostfile ...
    --launcher pdsh` (the compat package's command: dslaunch) after writing the job's environment
    to ./.deepspeed_env, which dslaunch exports to the workers on both hosts."""
    env, home = ssh_home
    env.update({k: deepspeed_compat.env()[k] for k in ("PYTHONPATH", "PATH", "OMP_NUM_THREADS")})
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    # pdsh runs the system ssh, which reads the passwd home's ~/.ssh, not $HOME's
    env["PDSH_SSH_ARGS_APPEND"] = f"-o UserKnownHostsFile={home}/.ssh/known_hosts -o LogLevel=ERROR"
    env["DSLAUNCH_SSH_KEY"] = str(home / ".ssh" / "id_ed25519")  # options Accelerate does not pass, by variable
    h1, h2 = ns_cluster.hosts
    hosts = tmp_path / "hostfile"
    hosts.write_text(f"{h1.ip} slots=1\n{h2.ip} slots=1\n")
    cfg = tmp_path / "ds.json"
    # No optimizer in the config and CPU offload: the script's torch AdamW becomes
    # deepspeed.ops.adam.DeepSpeedCPUAdam (Accelerate's map_pytorch_optim_to_deepspeed)
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
                               "gradient_clipping": 1.0,
                               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    from dist_harness import free_port

    port = str(free_port())  # free here; the cluster's hosts have network namespaces of their own
    res = subprocess.run([accelerate, "launch", "--use_deepspeed", "--deepspeed_config_file", str(cfg),
                          "--num_machines", "2", "--num_processes", "2", "--machine_rank", "0",
                          "--main_process_ip", h1.ip, "--main_process_port", port,
                          "--deepspeed_hostfile", str(hosts), "--deepspeed_multinode_launcher", "pdsh",
                          "--mixed_precision", "no", "--dynamo_backend", "no", JOB, str(tmp_path)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=360)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "ACCELERATE_USE_DEEPSPEED=" in (tmp_path / ".deepspeed_env").read_text()
    assert f"[{h1.ip}:0] rank 0 of 2 on {h1.name}" in res.stdout.splitlines(), res.stdout[-2000:]
    assert f"[{h2.ip}:1] rank 1 of 2 on {h2.name}" in res.stdout.splitlines(), res.stdout[-2000:]
    assert _check(tmp_path, sharded=False)["optimizer"] == "DeepSpeedCPUAdam"


SP_JOB = os.path.join(HERE, "workers", "accelerate_sp_job.py")


@pytest.mark.timeout(300)
def test_accelerate_launch_ulysses_sp2_equals_one_process(deepspeed_compat, tmp_path):
    """`ParallelismConfig(sp_backend="deepspeed", sp_size=2)` under `accelerate launch` on 2
    processes (tests/workers/accelerate_sp_job.py): Accelerate's version gate (DeepSpeed >=
    0.18.2) passes, its prepare registers Ulysses with transformers and wraps the loader,
    each rank trains on half of every sequence, and every step's loss equals a one-process
    torch run over the whole sequences to 1e-5."""
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
                               "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
                               "zero_allow_untested_optimizer": True, "steps_per_print": 1000}))
    # `python -m`: the venv's `accelerate` script may name another interpreter
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed",
                          "--deepspeed_config_file", str(cfg), "--num_processes", "2", "--num_machines", "1",
                          "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no", SP_JOB,
                          str(tmp_path)], env=deepspeed_compat.env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["num_processes"] == 2 and got["sp_world"] == 2 and got["engine"] == "DeepSpeedEngine"
    assert got["distributed_type"] == "DistributedType.DEEPSPEED"
    assert got["train_batch_size"] == 2  # one data-parallel rank: the sequence pair shares each batch
    assert got["shapes"] == [[2, 4]] * 4  # every batch of the loader, half of each sequence per rank
    assert max(abs(a - b) for a, b in zip(got["losses"], got["ref_losses"])) < TOL, got
