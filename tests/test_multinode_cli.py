"""Multi-node CLI paths that need no cluster: env forwarding rules, masking, usage errors."""
import subprocess
import sys

import pytest

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.ssh_env import MASK, forwarded_env, masked

DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher"]


def test_forwarded_env_prefixes_file_and_exports():
    environ = {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/x", "HF_TOKEN": "t",
               "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_HOME": "/cuda", "HOME": "/root", "PATH": "/bin", "MINE": "m",
               "OMP_NUM_THREADS": "4", "UCX_TLS": "tcp", "FI_PROVIDER": "efa", "TORCH_SHOW_CPP_STACKTRACES": "1"}
    got = forwarded_env(environ, {"FROM_FILE": "f", "NCCL_DEBUG": "WARN"}, ["MINE", "SET=a=b c"])
    assert got == {"FROM_FILE": "f", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/x",
                   "HF_TOKEN": "t", "CUDA_HOME": "/cuda", "OMP_NUM_THREADS": "4", "UCX_TLS": "tcp",
                   "FI_PROVIDER": "efa", "TORCH_SHOW_CPP_STACKTRACES": "1", "MINE": "m", "SET": "a=b c"}
    with pytest.raises(LaunchConfigError, match="--export NOPE: not set"):
        forwarded_env(environ, {}, ["NOPE"])
    with pytest.raises(LaunchConfigError, match="not a valid variable name"):
        forwarded_env(environ, {}, ["1BAD=x"])


def test_masking():
    env = {"RANK": "0", "HF_TOKEN": "secret"}
    assert masked(env, {"HF_TOKEN"}, show=False) == {"RANK": "0", "HF_TOKEN": MASK}
    assert masked(env, {"HF_TOKEN"}, show=True) == env


def _run(args, tmp_path, env=None):
    import os
    e = dict(os.environ, HOME=str(tmp_path), **(env or {}))
    return subprocess.run(DSLAUNCH + args, capture_output=True, text=True, cwd=tmp_path, env=e, timeout=60)


def test_dry_run_of_remote_layout_masks_and_shows_agents(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("alice@node-a slots=2\nnode-b slots=1\n")
    (tmp_path / "train.py").write_text("")
    res = _run(["--hostfile", str(hf), "--dry_run", "--master_addr", "10.1.1.1", "train.py", "a b"], tmp_path,
               env={"NCCL_IB_HCA": "mlx5", "HF_TOKEN": "hf_xyz"})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "dslaunch plan: 2 node(s), world size 3, master 10.1.1.1:29500" in out and "launcher ssh" in out
    assert "node 0: alice@node-a (remote: cd " in out and "-m dslaunch.launcher.agent" in out
    assert "HF_TOKEN=*** " in out and "NCCL_IB_HCA=***" in out and "hf_xyz" not in out + res.stderr
    assert "'a b'" in out and "RANK=2" in out
    shown = _run(["--hostfile", str(hf), "--dry_run", "--show_env", "--json", "train.py"], tmp_path,
                 env={"HF_TOKEN": "hf_xyz"})
    import json
    plan = json.loads(shown.stdout)
    assert plan["launcher"] == "ssh" and plan["nodes"][1]["workers"][0]["env"]["HF_TOKEN"] == "hf_xyz"


@pytest.mark.parametrize("launcher,exe,package", [("openmpi", "mpirun", "openmpi-bin"), ("slurm", "srun", "slurm-client")])
def test_missing_cluster_tool_is_one_line_naming_the_package(tmp_path, launcher, exe, package):
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=1\nnode-b slots=1\n")
    res = _run(["--hostfile", str(hf), "--launcher", launcher, "x.py"], tmp_path, env={"PATH": "/nonexistent"})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"dslaunch: error: --launcher {launcher} needs `{exe}`, which is not on PATH "
        f"(Debian/Ubuntu: apt-get install {package})"]
    dry = _run(["--hostfile", str(hf), "--launcher", launcher, "--dry_run", "--master_addr", "h", "x.py", "q r"],
               tmp_path, env={"NCCL_X": "v"})
    assert dry.returncode == 0 and exe in dry.stdout and "'q r'" in dry.stdout and "NCCL_X=***" in dry.stdout


def test_bad_export_and_bad_ssh_config_are_usage_errors(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=1\nnode-b slots=1\n")
    res = _run(["--hostfile", str(hf), "--export", "NOT_SET_ANYWHERE", "--dry_run", "x.py"], tmp_path)
    assert res.returncode == 2 and res.stderr.strip() == "dslaunch: error: --export NOT_SET_ANYWHERE: not set in the launcher's environment"
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host a\n  Port\n")
    hf.write_text("a slots=1\nnode-b slots=1\n")
    res = _run(["--hostfile", str(hf), "--dry_run", "x.py"], tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"dslaunch: error: {tmp_path}/.ssh/config: cannot parse ssh config: Unparsable line Port"
