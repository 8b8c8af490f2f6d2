"""Multi-node CLI paths that need no cluster: env forwarding rules, masking, usage errors."""
import subprocess

import pytest

from dslaunch.launcher.envfile import EnvFile, EnvFiles
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.masking import MASK, looks_secret, masked
from dslaunch.launcher.options import LaunchOptions
from dslaunch.launcher.plan import passed_env
from dist_harness import DSLAUNCH


def test_forwarded_env_prefixes_file_and_exports():
    environ = {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/x", "HF_TOKEN": "t",
               "CUDA_VISIBLE_DEVICES": "0,1", "CUDA_HOME": "/cuda", "HOME": "/root", "PATH": "/bin", "MINE": "m",
               "OMP_NUM_THREADS": "4", "UCX_TLS": "tcp", "FI_PROVIDER": "efa", "TORCH_SHOW_CPP_STACKTRACES": "1"}
    files = EnvFiles((EnvFile("f", {"FROM_FILE": "f", "NCCL_DEBUG": "WARN"}),))
    opts = LaunchOptions("x.py", export=("MINE", "SET=a=b c"))
    got, hidden = passed_env(opts, environ, files, remote=True)
    assert got == {"FROM_FILE": "f", "NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/x",
                   "HF_TOKEN": "t", "CUDA_HOME": "/cuda", "OMP_NUM_THREADS": "4", "UCX_TLS": "tcp",
                   "FI_PROVIDER": "efa", "TORCH_SHOW_CPP_STACKTRACES": "1", "MINE": "m", "SET": "a=b c"}
    assert hidden == {"FROM_FILE", "NCCL_DEBUG", "SET"}  # by origin: the env file and --export VALUE
    # this machine's workers inherit the environment: only the file and --export values are added
    here, _ = passed_env(opts, environ, files, remote=False)
    assert here == {"FROM_FILE": "f", "NCCL_DEBUG": "WARN", "SET": "a=b c"}
    with pytest.raises(LaunchConfigError, match="--export NOPE: not set"):
        passed_env(LaunchOptions("x.py", export=("NOPE",)), environ, EnvFiles(), remote=True)
    with pytest.raises(LaunchConfigError, match="not a valid variable name"):
        passed_env(LaunchOptions("x.py", export=("1BAD=x",)), environ, EnvFiles(), remote=True)


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("MYPASS", True), ("DB_PASSWORD", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("GITHUB_AUTH", True), ("PYTHONUNBUFFERED", False), ("NCCL_DEBUG", False), ("PYTHONPATH", False), ("RANK", False),
])
def test_secret_looking_names(name, secret):
    assert looks_secret(name) is secret


def test_masking_by_name_or_origin():
    env = {"RANK": "0", "HF_TOKEN": "secret", "FROM_FILE": "v", "PYTHONUNBUFFERED": "1"}
    assert masked(env, {"FROM_FILE"}, show=False) == {"RANK": "0", "HF_TOKEN": MASK, "FROM_FILE": MASK,
                                                       "PYTHONUNBUFFERED": "1"}
    assert masked(env, {"FROM_FILE"}, show=True) == env


def _run(args, tmp_path, env=None):
    import os
    e = dict(os.environ, HOME=str(tmp_path), **(env or {}))
    e.pop("DSLAUNCH_MASTER_PORT", None)  # dry runs here show the default port (conftest sets 0)
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
    assert "node 0: alice@node-a (remote) slots 0-1 ranks 0-1\n  agent: cd " in out
    assert "-m dslaunch.launcher.agent" in out
    # masked by name (HF_TOKEN); NCCL_IB_HCA is forwarded by prefix and not secret-looking
    assert "HF_TOKEN=*** " in out and "NCCL_IB_HCA=mlx5" in out and "hf_xyz" not in out + res.stderr
    assert "'a b'" in out and "RANK=2" in out
    shown = _run(["--hostfile", str(hf), "--dry_run", "--show_env", "--json", "train.py"], tmp_path,
                 env={"HF_TOKEN": "hf_xyz"})
    import json
    plan = json.loads(shown.stdout)
    assert plan["launcher"] == "ssh" and plan["nodes"][1]["workers"][0]["env"]["HF_TOKEN"] == "hf_xyz"
    assert plan["backend"]["agents"]["node-b"].endswith("-u -m dslaunch.launcher.agent")


@pytest.mark.parametrize("launcher,exe,package", [("openmpi", "mpirun", "openmpi-bin"), ("slurm", "srun", "slurm-client")])
def test_missing_cluster_tool_is_one_line_naming_the_package(tmp_path, launcher, exe, package):
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=1\nnode-b slots=1\n")
    res = _run(["--hostfile", str(hf), "--launcher", launcher, "x.py"], tmp_path, env={"PATH": "/nonexistent"})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"dslaunch: error: --launcher {launcher} needs `{exe}`, which is not on PATH "
        f"(Debian/Ubuntu: apt-get install {package})"]
    dry = _run(["--hostfile", str(hf), "--launcher", launcher, "--dry_run", "--master_addr", "h",
                "--export", "MYPASS=hunter2", "x.py", "q r"], tmp_path, env={"NCCL_X": "v", "NCCL_TOKEN": "tok"})
    assert dry.returncode == 0, dry.stderr
    command = next(line for line in dry.stdout.splitlines() if line.startswith("command: "))
    assert f" {exe} " in command and "'q r'" in command and "NCCL_X=v" in command
    assert "NCCL_TOKEN=***" in command and "MYPASS=***" in command and "hunter2" not in dry.stdout + dry.stderr


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
