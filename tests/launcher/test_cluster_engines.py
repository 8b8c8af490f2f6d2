"""Real Open MPI and Slurm jobs through `dslaunch --launcher openmpi|slurm` on the
network-namespace test bed (tests/testbed.py), not just their generated command lines.

Open MPI: mpirun in our namespace starts its orteds on the hosts over the test bed's sshd,
with the system ssh reading $HOME's ~/.ssh (system_ssh_args). Slurm: munged and slurmctld
here, one slurmd per host namespace (tests/slurm_cluster.py), started once for this module
and stopped by PID after it. Every test ends with no job process left on any host: the
hosts share our PID namespace, so /proc shows theirs.
"""
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import slurm_cluster
import testbed
from dist_harness import DSLAUNCH

pytestmark = pytest.mark.testbed

ALLREDUCE = """
    import os, socket, datetime, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    e = os.environ
    print(f"sum={x.item():g} rank={e['RANK']}/{e['WORLD_SIZE']} local={e['LOCAL_RANK']}/{e['LOCAL_WORLD_SIZE']} "
          f"node={e['NODE_RANK']} host={socket.gethostname()} acc={e['DSLAUNCH_ACCELERATOR']}", flush=True)
    dist.destroy_process_group()
"""
CONTRACT = """
    import os, socket
    e = os.environ
    print(f"rank={e['RANK']}/{e['WORLD_SIZE']} local={e['LOCAL_RANK']}/{e['LOCAL_WORLD_SIZE']} node={e['NODE_RANK']} "
          f"host={socket.gethostname()} master={e['MASTER_ADDR']}", flush=True)
"""
FAIL = """
    import os, sys, time
    sys.stdout.write(f"pid {os.getpid()}\\n")
    if os.environ["RANK"] == "3":
        time.sleep(1.0)
        sys.stderr.write("rank 3 is about to fail\\n")
        sys.exit(7)
    time.sleep(120)
"""
SLEEP = """
    import os, sys, time
    sys.stdout.write(f"pid {os.getpid()}\\n")
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def slurm(ns_cluster, tmp_path_factory):
    try:
        cluster = slurm_cluster.start(ns_cluster, tmp_path_factory.mktemp("slurm"))
    except testbed.TestbedUnavailable as exc:
        pytest.skip(f"cannot start the Slurm cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


def _script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p.name


def _hostfile(tmp_path, tb):
    p = tmp_path / "hosts"
    p.write_text("".join(f"{h.name} slots=2\n" for h in tb.hosts))
    return str(p)


def _expected_allreduce(tb):
    return sorted(f"sum=10 rank={r}/4 local={r % 2}/2 node={r // 2} host={tb.hosts[r // 2].name} acc=cpu"
                  for r in range(4))


def _job_processes(tb, keep=(), timeout=10.0):
    """Live processes in the host namespaces other than the sshd listeners and `keep` (the
    slurmds), after waiting up to `timeout` for them to end."""
    allowed = set(tb.sshd_pids()) | set(keep)
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in tb.host_pids():
            if pid in allowed:
                continue
            try:
                left.append(" ".join(psutil.Process(pid).cmdline()))
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _pids_then_kill(argv, env, cwd, n, sig):
    head = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = []
        deadline = time.monotonic() + 60
        while len(pids) < n and time.monotonic() < deadline:
            line = head.stdout.readline()
            if not line:
                break
            if line.startswith("pid "):
                pids.append(int(line.split()[1]))
        assert len(pids) == n, (pids, head.stderr.read() if head.poll() is not None else "")
        head.send_signal(sig)
        return head.wait(timeout=30), pids
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()


def _live_tool(name, workdir):
    """Live (not zombie) `name` processes of this test's job, found by its working directory."""
    out = []
    for p in psutil.process_iter(["name"]):
        try:
            if p.info["name"] == name and p.status() != psutil.STATUS_ZOMBIE and str(workdir) in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


# ---------------------------------------------------------------------------------- Open MPI
@pytest.mark.timeout(120)
def test_openmpi_allreduce_and_check(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    hf = _hostfile(tmp_path, ns_cluster)
    # the probe started by mpirun, whose ssh sees $HOME's ~/.ssh as dslaunch's paramiko does
    check = subprocess.run(DSLAUNCH + ["check", "--hostfile", hf, "--launcher", "openmpi"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert all(f"{h.name}  yes" in check.stdout for h in ns_cluster.hosts), check.stdout
    script = _script(tmp_path, "allreduce.py", ALLREDUCE)
    res = subprocess.run(DSLAUNCH + ["--launcher", "openmpi", "--hostfile", hf, "--no_local_rank", script],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("sum=")) == _expected_allreduce(ns_cluster)
    assert "mpirun -n 4 -H " in res.stderr and "--allow-run-as-root" in res.stderr
    assert not _job_processes(ns_cluster)


@pytest.mark.timeout(90)
def test_openmpi_remote_failure_is_the_job_exit_code(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    hf = _hostfile(tmp_path, ns_cluster)
    res = subprocess.run(DSLAUNCH + ["--launcher", "openmpi", "--hostfile", hf, "--no_local_rank",
                                     _script(tmp_path, "fail.py", FAIL)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=80)
    assert res.returncode == 7, res.stderr
    assert "rank 3 is about to fail" in res.stderr
    assert len([line for line in res.stdout.splitlines() if line.startswith("pid ")]) == 4, res.stdout
    assert not _job_processes(ns_cluster)


@pytest.mark.timeout(90)
def test_openmpi_sigkill_of_dslaunch_leaves_nothing(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    hf = _hostfile(tmp_path, ns_cluster)
    code, pids = _pids_then_kill(DSLAUNCH + ["--launcher", "openmpi", "--hostfile", hf, "--no_local_rank",
                                             _script(tmp_path, "sleep.py", SLEEP)], env, tmp_path, 4, signal.SIGKILL)
    assert code == -9
    # mpirun got SIGTERM from the kernel (parent-death signal) and stopped its orteds and ranks
    assert not _job_processes(ns_cluster, timeout=20)
    assert not _live_tool("mpirun", tmp_path)


# ------------------------------------------------------------------------------------- Slurm
@pytest.mark.timeout(120)
def test_slurm_allreduce_with_hostfile(ns_cluster, ssh_home, slurm, tmp_path):
    env = slurm.env(ssh_home[0])
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    script = _script(tmp_path, "allreduce.py", ALLREDUCE)
    res = subprocess.run(DSLAUNCH + ["--launcher", "slurm", "--hostfile", _hostfile(tmp_path, ns_cluster),
                                     "--no_local_rank", script],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("sum=")) == _expected_allreduce(ns_cluster)
    assert not _job_processes(ns_cluster, keep=slurm.daemon_pids())


@pytest.mark.timeout(120)
def test_slurm_inside_salloc_needs_no_hostfile_and_check_runs_through_srun(ns_cluster, ssh_home, slurm, tmp_path):
    env = slurm.env(ssh_home[0])
    script = _script(tmp_path, "contract.py", CONTRACT)
    names = [h.name for h in ns_cluster.hosts]
    # salloc runs the command here with SLURM_JOB_NODELIST=<prefix>-h[1-2], SLURM_TASKS_PER_NODE=2(x2)
    res = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=2", *DSLAUNCH, "--launcher", "slurm",
                          "--no_local_rank", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("rank=")) == sorted(
        f"rank={r}/4 local={r % 2}/2 node={r // 2} host={names[r // 2]} master={names[0]}" for r in range(4))
    assert f"-w {','.join(names)}" in res.stderr
    check = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=2", *DSLAUNCH, "check", "--launcher", "slurm"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert all(f"{n}  yes" in check.stdout for n in names), check.stdout
    bad = subprocess.run(["salloc", "-N", "2", "--ntasks-per-node=2", *DSLAUNCH, "check", "--launcher", "slurm",
                          "--remote_python", "/nonexistent/python"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert all(f"{n} (no answer through srun" in bad.stderr for n in names), bad.stderr
    assert not _job_processes(ns_cluster, keep=slurm.daemon_pids())


@pytest.mark.timeout(90)
def test_slurm_remote_failure_is_the_job_exit_code(ns_cluster, ssh_home, slurm, tmp_path):
    env = slurm.env(ssh_home[0])
    h2 = ns_cluster.hosts[1].name
    res = subprocess.run(DSLAUNCH + ["--launcher", "slurm", "--hostfile", _hostfile(tmp_path, ns_cluster),
                                     "--no_local_rank", _script(tmp_path, "fail.py", FAIL)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=80)
    # srun itself exits 143 (the SIGTERM it sent the other ranks); the job's code is rank 3's
    assert res.returncode == 7, res.stderr
    assert res.stderr.index("rank 3 is about to fail") < res.stderr.index(
        f"dslaunch: {h2}:3 failed first: exited with code 7")
    assert len([line for line in res.stdout.splitlines() if line.startswith("pid ")]) == 4, res.stdout
    assert not _job_processes(ns_cluster, keep=slurm.daemon_pids())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_slurm_signal_to_dslaunch_leaves_nothing(ns_cluster, ssh_home, slurm, tmp_path, sig):
    env = slurm.env(ssh_home[0])
    code, pids = _pids_then_kill(DSLAUNCH + ["--launcher", "slurm", "--hostfile", _hostfile(tmp_path, ns_cluster),
                                             "--no_local_rank", _script(tmp_path, "sleep.py", SLEEP)],
                                 env, tmp_path, 4, sig)
    # SIGINT: dslaunch stops srun with SIGTERM (srun takes a first SIGINT as "print the tasks' states")
    # SIGKILL: srun got SIGTERM from the kernel (parent-death signal); either way it cancels the step
    assert code == (130 if sig == signal.SIGINT else -9)
    assert not _job_processes(ns_cluster, keep=slurm.daemon_pids(), timeout=20)
    assert not _live_tool("srun", tmp_path)
    queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=10)
    assert queue.returncode == 0 and not [line for line in queue.stdout.splitlines() if " R " in line], queue.stdout
