"""Commands for --launcher pdsh / openmpi / slurm, built from the one plan, and the per-rank env shim."""
import os
import shlex
import subprocess
import sys

import pytest

from dslaunch.launcher.backends import names, require_tool
from dslaunch.launcher.backends import openmpi, pdsh, slurm
from dslaunch.launcher.cluster_env import contract_from
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.machine import MachineFacts
from dslaunch.launcher.options import LaunchOptions
from dslaunch.launcher.plan import build_plan

ARGS = ("--msg", "a b;$HOME 'q'", "")


def plan(tmp_path, hosts="alice@n1 slots=2\nn2 slots=2\n", **kw):
    hf = tmp_path / "hosts"
    hf.write_text(hosts)
    opts = LaunchOptions("train.py", ARGS, hostfile=str(hf), master_addr="10.0.0.1", master_port=29511,
                         workdir="/work dir", remote_python="/venv/bin/python", **kw)
    facts = MachineFacts(0, None, 8, ("localhost",), python="/venv/bin/python", cwd=str(tmp_path), home=str(tmp_path))
    return build_plan(opts, facts, {"NCCL_DEBUG": "INFO", "HF_TOKEN": "x y"}, run_id="r1")


def test_backends_are_discovered_one_module_each():
    assert names() == ["ssh", "openmpi", "pdsh", "slurm"]


def test_pdsh_command_quotes_every_word_and_substitutes_node_rank(tmp_path):
    p = plan(tmp_path, launcher_args="-u 30")
    cmd = pdsh.BACKEND.describe(p)["command"]
    assert cmd[:8] == ["pdsh", "-S", "-R", "ssh", "-f", "2", "-w", "alice@n1,n2"]
    assert cmd[8:10] == ["-u", "30"]
    # what the remote shell sees after pdsh's substitution (%% -> %, %n -> 1): no plan, no value
    shell_line = cmd[-1].replace("%n", "1").replace("%%", "%")
    words = shlex.split(shell_line)
    assert words[:5] == ["cd", "/work dir", "&&", "exec", "/venv/bin/python"]
    assert words[5:9] == ["-u", "-m", "dslaunch.launcher.agent", "--request_file"]
    assert words[9] == "/work dir/.dslaunch/request-RUN-1.json" and len(words) == 10
    assert "x y" not in " ".join(cmd) and "a b;" not in " ".join(cmd)


def test_openmpi_command_exports_names_not_values_and_maps_ranks(tmp_path):
    argv, env = openmpi.command(plan(tmp_path))
    assert argv[:5] == ["mpirun", "-n", "4", "-H", "alice@n1:2,n2:2"]
    assert argv[argv.index("--wdir") + 1] == "/work dir"
    exported = [argv[i + 1] for i, w in enumerate(argv) if w == "-x"]
    assert {"MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "HF_TOKEN", "WORLD_SIZE"} <= set(exported)
    assert not {"RANK", "LOCAL_RANK", "NODE_RANK"} & set(exported)  # per rank: the shim's business
    assert "x y" not in argv  # values travel in the environment, never on the command line
    assert (env["HF_TOKEN"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("x y", "10.0.0.1", "29511")
    tail = argv[argv.index("dslaunch.launcher.cluster_env") - 2:]
    assert tail == ["/venv/bin/python", "-m", "dslaunch.launcher.cluster_env", "--local_rank_at", "3", "--",
                    "/venv/bin/python", "-u", "train.py", *ARGS]
    shown = openmpi.BACKEND.describe(plan(tmp_path))
    assert shown["env"]["HF_TOKEN"] == "***" and shown["env"]["NCCL_DEBUG"] == "INFO"


def test_slurm_command_and_uneven_slots_error(tmp_path):
    argv, env = slurm.command(plan(tmp_path, launcher_args="--partition gpu", no_local_rank=True))
    assert argv[:7] == ["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "-w"]
    assert argv[7] == "n1,n2"
    assert "--export=ALL" in argv and "--chdir=/work dir" in argv
    assert argv[argv.index("--partition") + 1] == "gpu"
    assert "--local_rank_at" not in argv and env["MASTER_PORT"] == "29511"
    with pytest.raises(LaunchConfigError, match="same number of processes"):
        slurm.command(plan(tmp_path, hosts="n1 slots=2\nn2 slots=1\n"))


def test_bad_launcher_args_and_missing_tool_name_the_package(tmp_path):
    with pytest.raises(LaunchConfigError, match="--launcher_args"):
        openmpi.command(plan(tmp_path, launcher_args="'unterminated"))
    for exe, package in [("pdsh", "pdsh"), ("mpirun", "openmpi-bin"), ("srun", "slurm-client")]:
        with pytest.raises(LaunchConfigError, match=f"apt-get install {package}"):
            require_tool(exe, package, "x", which=lambda exe: None)
    assert require_tool("pdsh", "pdsh", "pdsh", which=lambda exe: "/usr/bin/" + exe) == "/usr/bin/pdsh"


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


def test_shim_inserts_local_rank_where_asked(tmp_path):
    env = dict(os.environ, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1")
    code = "import sys; print(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cluster_env", "--local_rank_at", "3", "--",
                          sys.executable, "-c", code, "x"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['--local_rank=1', 'x']"
    argv, _ = slurm.command(plan(tmp_path))
    i = argv.index("dslaunch.launcher.cluster_env")
    assert argv[i + 1:i + 4] == ["--local_rank_at", "3", "--"]
