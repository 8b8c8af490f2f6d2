"""Command generation for --launcher pdsh / openmpi / slurm, and the per-rank env shim."""
import os
import shlex
import subprocess
import sys

import pytest

from dslaunch.launcher.cluster import (
    ClusterError, ClusterJob, openmpi_command, pdsh_command, require_tool, slurm_command,
)
from dslaunch.launcher.cluster_env import contract_from

WORKER = ["/venv/bin/python", "-u", "train.py", "--msg", "a b;$HOME 'q'", ""]


def job(**kw):
    base = dict(hosts=[("alice@n1", 2), ("n2", 2)], worker_argv=WORKER, env={"NCCL_DEBUG": "INFO", "SECRET": "x y"},
                master_addr="10.0.0.1", master_port=29511, workdir="/work dir", python="/venv/bin/python")
    base.update(kw)
    return ClusterJob(**base)


def test_pdsh_command_quotes_every_word_and_substitutes_node_rank():
    agent = ["/venv/bin/python", "-m", "dslaunch.launcher.agent", "--plan", "abc=", "--x", "100%"]
    cmd = pdsh_command(job(launcher_args="-u 30"), agent)
    assert cmd.argv[:8] == ["pdsh", "-S", "-R", "ssh", "-f", "2", "-w", "alice@n1,n2"]
    assert cmd.argv[8:10] == ["-u", "30"]
    remote = cmd.argv[-1]
    assert remote.endswith(" --node_rank %n")
    # what the remote shell sees after pdsh's substitution (%% -> %, %n -> 1)
    shell_line = remote.replace("%n", "1").replace("%%", "%")
    words = shlex.split(shell_line)
    assert words[:5] == ["cd", "/work dir", "&&", "exec", "/venv/bin/python"]
    assert words[5:] == agent[1:] + ["--node_rank", "1"]


def test_openmpi_command_exports_names_not_values_and_maps_ranks():
    cmd = openmpi_command(job())
    a = cmd.argv
    assert a[:5] == ["mpirun", "-n", "4", "-H", "alice@n1:2,n2:2"]
    assert a[a.index("--wdir") + 1] == "/work dir"
    exported = [a[i + 1] for i, w in enumerate(a) if w == "-x"]
    assert exported == ["MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "SECRET"]
    assert "x y" not in a  # values travel in the environment, never on the command line
    assert cmd.env == {"NCCL_DEBUG": "INFO", "SECRET": "x y", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511"}
    tail = a[a.index("dslaunch.launcher.cluster_env") - 2:]
    assert tail == ["/venv/bin/python", "-m", "dslaunch.launcher.cluster_env", "--", *WORKER]
    with_file = openmpi_command(job(), hostfile_path="/tmp/hf")
    assert with_file.argv[3:5] == ["--hostfile", "/tmp/hf"]


def test_slurm_command_and_uneven_slots_error():
    cmd = slurm_command(job(launcher_args="--partition gpu"))
    a = cmd.argv
    assert a[:7] == ["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "-w"]
    assert a[7] == "n1,n2"
    assert "--export=ALL" in a and "--chdir=/work dir" in a
    assert a[a.index("--partition") + 1] == "gpu"
    assert cmd.env["MASTER_PORT"] == "29511"
    with pytest.raises(ClusterError, match="same number of processes"):
        slurm_command(job(hosts=[("n1", 2), ("n2", 1)]))


def test_bad_launcher_args_and_missing_tool_name_the_package():
    with pytest.raises(ClusterError, match="--launcher_args"):
        openmpi_command(job(launcher_args="'unterminated"))
    for launcher, package in [("pdsh", "pdsh"), ("openmpi", "openmpi-bin"), ("slurm", "slurm-client")]:
        with pytest.raises(ClusterError, match=f"apt-get install {package}"):
            require_tool(launcher, which=lambda exe: None)
    assert require_tool("pdsh", which=lambda exe: "/usr/bin/" + exe) == "/usr/bin/pdsh"


@pytest.mark.parametrize("environ,expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "GROUP_RANK": "1"}),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
      "SLURM_TASKS_PER_NODE": "2(x3)"},
     {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "NODE_RANK": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "2"}),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
      "SLURM_TASKS_PER_NODE": "2,1"},
     {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "NODE_RANK": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1"}),
    ({"PATH": "/bin"}, {}),
])
def test_rank_contract_from_tool_variables(environ, expected):
    assert contract_from(environ) == expected


def test_shim_execs_the_worker_with_the_contract():
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2",
               OMPI_COMM_WORLD_LOCAL_RANK="1", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    code = "import os,sys; print(os.environ['RANK'], os.environ['LOCAL_RANK'], sys.argv[1:])"
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cluster_env", "--", sys.executable, "-c", code, "a b", ""],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "1 1 ['a b', '']"
    bare = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cluster_env", "--", "true"],
                          env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert bare.returncode == 2 and "OMPI_COMM_WORLD_RANK" in bare.stderr


def test_shim_inserts_local_rank_where_asked():
    env = dict(os.environ, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1")
    code = "import sys; print(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cluster_env", "--local_rank_at", "3", "--",
                          sys.executable, "-c", code, "x"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['--local_rank=1', 'x']"
    cmd = slurm_command(job(local_rank_at=3))
    i = cmd.argv.index("dslaunch.launcher.cluster_env")
    assert cmd.argv[i + 1:i + 4] == ["--local_rank_at", "3", "--"]
