"""Commands for --launcher pdsh / openmpi / slurm, built from the one plan, and the per-rank env shim."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from dslaunch.launcher.backends import names, require_tool
from dslaunch.launcher.backends import openmpi, pdsh, slurm
from dslaunch.launcher.allocation import allocation_hosts, expand_nodelist
from dslaunch.launcher.backends.slurm import task_failure
from dslaunch.launcher.cluster_env import contract_from, node_rank_of
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
    argv, env = openmpi.command(plan(tmp_path), environ={"HOME": str(tmp_path)}, euid=1000, passwd_home=str(tmp_path))
    assert argv[:5] == ["mpirun", "-n", "4", "-H", "alice@n1:2,n2:2"]
    assert argv[argv.index("--wdir") + 1] == "/work dir"
    exported = [argv[i + 1] for i, w in enumerate(argv) if w == "-x"]
    assert {"MASTER_ADDR", "MASTER_PORT", "NCCL_DEBUG", "HF_TOKEN", "WORLD_SIZE"} <= set(exported)
    assert not {"RANK", "LOCAL_RANK", "NODE_RANK"} & set(exported)  # per rank: the shim's business
    assert "x y" not in argv  # values travel in the environment, never on the command line
    assert (env["HF_TOKEN"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("x y", "10.0.0.1", "29511")
    tail = argv[argv.index("dslaunch.launcher.cluster_env") - 2:]
    assert tail == ["/venv/bin/python", "-m", "dslaunch.launcher.cluster_env", "--node_sizes", "2,2",
                    "--whole_lines", "--local_rank_at", "3", "--", "/venv/bin/python", "-u", "train.py", *ARGS]
    assert argv[argv.index("plm_rsh_args") + 1] == "-o BatchMode=yes -o ConnectTimeout=10"
    assert "--allow-run-as-root" not in argv
    shown = openmpi.BACKEND.describe(plan(tmp_path))
    assert shown["env"]["HF_TOKEN"] == "***" and shown["env"]["NCCL_DEBUG"] == "INFO"


def test_openmpi_as_root_and_the_rsh_agent_sees_what_dslaunch_sees(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host n1\n  HostName 10.0.0.5\n")
    p = plan(tmp_path, ssh_key="/k/id", ssh_port=2222, ssh_user="bob", accept_new_host_keys=True)
    argv, _ = openmpi.command(p, environ={"HOME": str(home)}, euid=0, passwd_home="/root")
    assert argv.count("--allow-run-as-root") == 1
    # $HOME is not the passwd home, which is all OpenSSH reads: point it at $HOME's files, as paramiko reads them
    assert argv[argv.index("plm_rsh_args") + 1].split() == [
        "-F", f"{home}/.ssh/config", "-o", f"UserKnownHostsFile={home}/.ssh/known_hosts", "-i", "/k/id",
        "-p", "2222", "-l", "bob", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
        "-o", "StrictHostKeyChecking=accept-new"]
    argv, _ = openmpi.command(plan(tmp_path, launcher_args="--allow-run-as-root"), environ={}, euid=0, passwd_home="/")
    assert argv.count("--allow-run-as-root") == 1
    with pytest.raises(LaunchConfigError, match="containing a space"):
        openmpi.command(plan(tmp_path, ssh_key="/my keys/id"), environ={}, euid=0, passwd_home="/")


def test_slurm_command_and_uneven_slots_error(tmp_path):
    argv, env = slurm.command(plan(tmp_path, launcher_args="--partition gpu", no_local_rank=True))
    assert argv[:7] == ["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "-w"]
    assert argv[7] == "n1,n2"
    assert "--export=ALL" in argv and "--chdir=/work dir" in argv
    assert argv[argv.index("--partition") + 1] == "gpu"
    assert "--local_rank_at" not in argv and env["MASTER_PORT"] == "29511"
    with pytest.raises(LaunchConfigError, match="same number of processes"):
        slurm.command(plan(tmp_path, hosts="n1 slots=2\nn2 slots=1\n"))


@pytest.mark.parametrize("backend", [openmpi.BACKEND, slurm.BACKEND], ids=["openmpi", "slurm"])
def test_tool_backends_refuse_what_only_our_own_supervision_does(tmp_path, backend):
    with pytest.raises(LaunchConfigError, match=f"--max_restarts is not supported with --launcher {backend.name}"):
        backend.check(plan(tmp_path, max_restarts=1))
    with pytest.raises(LaunchConfigError, match=f"--log_dir is not supported with --launcher {backend.name}"):
        backend.check(plan(tmp_path, log_dir=str(tmp_path / "logs")))


def test_bad_launcher_args_and_missing_tool_name_the_package(tmp_path):
    with pytest.raises(LaunchConfigError, match="--launcher_args"):
        openmpi.command(plan(tmp_path, launcher_args="'unterminated"))
    for exe, package in [("pdsh", "pdsh"), ("mpirun", "openmpi-bin"), ("srun", "slurm-client")]:
        with pytest.raises(LaunchConfigError, match=f"apt-get install {package}"):
            require_tool(exe, package, "x", which=lambda exe: None)
    assert require_tool("pdsh", "pdsh", "pdsh", which=lambda exe: "/usr/bin/" + exe) == "/usr/bin/pdsh"


@pytest.mark.parametrize("environ,expected", [
    # OMPI_COMM_WORLD_NODE_RANK (1 here, rank 3 being node 1's second process) is not the node index
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"},
     {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}),
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


def test_openmpi_node_rank_comes_from_the_node_sizes():
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "OMPI_COMM_WORLD_NODE_RANK": "0"}
    got = contract_from(ompi, node_sizes=[2, 1, 2])
    assert (got["NODE_RANK"], got["GROUP_RANK"]) == ("1", "1")
    assert [node_rank_of(r, [2, 1, 2]) for r in range(5)] == [0, 0, 1, 2, 2]
    with pytest.raises(ValueError, match="beyond"):
        node_rank_of(5, [2, 1, 2])


@pytest.mark.parametrize("spec,names", [
    ("dt20-h[1-2]", ["dt20-h1", "dt20-h2"]),
    ("gpu[01-03,7],login1", ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]),
    ("a[9-10]b,c", ["a9b", "a10b", "c"]),
    ("single", ["single"]),
])
def test_slurm_nodelist_expansion(spec, names):
    assert expand_nodelist(spec) == names


def test_allocation_replaces_the_hostfile_for_slurm_only(tmp_path):
    environ = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)", "PATH": "/bin"}
    facts = MachineFacts(0, None, 8, ("localhost",), python="/venv/bin/python", cwd=str(tmp_path), home=str(tmp_path))
    p = build_plan(LaunchOptions("train.py", launcher="slurm", no_local_rank=True), facts, environ, run_id="r")
    assert [(n.node.host, n.node.local_world_size, n.local) for n in p.nodes] == [("n1", 2, False), ("n2", 2, False)]
    assert p.master_addr == "n1"
    assert slurm.command(p)[0][:8] == ["srun", "-N", "2", "-n", "4", "--ntasks-per-node=2", "-w", "n1,n2"]
    # other launchers ignore the allocation: this machine alone
    (tmp_path / "train.py").write_text("")
    local = build_plan(LaunchOptions("train.py", no_local_rank=True), facts, environ, run_id="r")
    assert [n.node.host for n in local.nodes] == ["localhost"]
    assert [h.slots for h in allocation_hosts({"SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "3,1"})] == [3, 1]
    for bad, what in [({"SLURM_JOB_NODELIST": "a[1-"}, "SLURM_JOB_NODELIST"),
                      ({"SLURM_JOB_NODELIST": "a[3-1]"}, "backwards"),
                      ({"SLURM_JOB_NODELIST": "a,b", "SLURM_TASKS_PER_NODE": "2(x3)"}, "one count per node")]:
        with pytest.raises(LaunchConfigError, match=re.escape(what)):
            allocation_hosts(bad)


def test_srun_task_failure_lines():
    assert task_failure("srun: error: h2: task 3: Exited with exit code 7") == ("h2:3", 7)
    assert task_failure("srun: error: h1: tasks 0-1: Killed") == ("h1:0", 137)
    assert task_failure("srun: error: h1: task 2: Segmentation fault (core dumped)") == ("h1:2", 139)
    assert task_failure("srun: error: h1: task 2: Exited with exit code 0") is None
    assert task_failure("srun: launch/slurm: _step_signal: Terminating StepId=2.0") is None


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


def test_relay_writes_whole_lines_only():
    """Each write the relay makes ends at a line end, however the child's writes were cut."""
    import io

    from dslaunch.launcher.cluster_env import relay_lines

    class Chunks(io.RawIOBase):  # hands out the child's writes one at a time
        def __init__(self, parts):
            self.parts = list(parts)

        def read1(self, n):
            return self.parts.pop(0) if self.parts else b""

    r, w = os.pipe()
    writes = []
    real = os.write
    try:
        os.write = lambda fd, data: (writes.append(bytes(data)), len(data))[1] if fd == w else real(fd, data)
        relay_lines(Chunks([b"sum=10 rank=0", b"\n", b"a\nb", b"c\rd", b"\n", b"tail"]), w)
    finally:
        os.write = real
        os.close(r)
        os.close(w)
    assert writes == [b"sum=10 rank=0\n", b"a\n", b"bc\r", b"d\n", b"tail"]


def test_shim_with_whole_lines_keeps_the_child_code_and_signal():
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", PYTHONUNBUFFERED="1")
    shim = [sys.executable, "-m", "dslaunch.launcher.cluster_env", "--whole_lines", "--", sys.executable, "-c"]
    res = subprocess.run(shim + ["import sys; print('out'); print('err', file=sys.stderr); sys.exit(7)"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (7, "out\n", "err\n")
    proc = subprocess.Popen(shim + ["import time; print('up', flush=True); time.sleep(60)"], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "up\n"
    proc.terminate()  # mpirun's SIGTERM reaches the worker, and the shim ends by it too
    assert proc.wait(timeout=30) == -15


def test_shim_inserts_local_rank_where_asked(tmp_path):
    env = dict(os.environ, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1")
    code = "import sys; print(sys.argv[1:])"
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cluster_env", "--local_rank_at", "3", "--",
                          sys.executable, "-c", code, "x"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['--local_rank=1', 'x']"
    argv, _ = slurm.command(plan(tmp_path))
    i = argv.index("dslaunch.launcher.cluster_env")
    assert argv[i + 1:i + 4] == ["--local_rank_at", "3", "--"]


def test_check_through_a_tool_needs_hosts_and_the_tool(tmp_path):
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    run = lambda args, env: subprocess.run([sys.executable, "-m", "dslaunch.launcher", "check", *args], env=env,
                                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    res = run(["--launcher", "slurm"], base)
    assert res.returncode == 2 and res.stderr.strip() == (
        "dslaunch check: --hostfile is required (or --launcher slurm inside a Slurm allocation)")
    res = run(["--launcher", "slurm"], {**base, "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)",
                                        "PATH": "/nonexistent"})
    assert res.returncode == 2 and res.stderr.strip() == (
        "dslaunch check: --launcher slurm needs `srun`, which is not on PATH (Debian/Ubuntu: apt-get install slurm-client)")
