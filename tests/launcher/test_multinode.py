"""Multi-node launches through the `dslaunch` CLI across the namespace SSH cluster.

Every host is a network namespace with its own sshd (tests/testbed.py); the namespaces
share our PID namespace, so psutil sees remote workers and can prove that none survives.
Only the all_reduce test imports torch in its workers; the rest use plain Python.
"""
import json
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import repo_paths
from dist_harness import DSLAUNCH

pytestmark = pytest.mark.testbed


def _hostfile(tmp_path, lines):
    p = tmp_path / "hosts"
    p.write_text("".join(f"{line}\n" for line in lines))
    return str(p)


def _script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def _live(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while _live(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _live(pids)


def _only_sshd_left(tb, timeout=5.0):
    """Every process in the host namespaces is an sshd listener again (sessions may take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        extra = [p for p in tb.host_pids() if p not in tb.sshd_pids()]
        if not extra or time.monotonic() > deadline:
            return [" ".join(psutil.Process(p).cmdline()) for p in _live(extra)]
        time.sleep(0.05)


def _run(args, env, cwd, timeout=90):
    return subprocess.run(DSLAUNCH + args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(180)
def test_two_nodes_two_processes_gloo_all_reduce(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    env["GLOO_SOCKET_IFNAME"] = "eth0"  # forwarded to the hosts by its prefix
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.name} slots=2", f"{h2.name} slots=2"])
    script = _script(tmp_path, "allreduce.py", """
        import os, socket, datetime, torch, torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        print(f"sum={x.item():g} rank={dist.get_rank()} host={socket.gethostname()} "
              f"local={os.environ['LOCAL_RANK']} ifname={os.environ['GLOO_SOCKET_IFNAME']}")
        dist.destroy_process_group()
    """)
    res = _run(["--hostfile", hf, "--master_port", "0", "--no_local_rank", script], env, tmp_path, timeout=150)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if "sum=" in line)
    assert len(lines) == 4, res.stdout
    for rank, line in enumerate(lines):
        host = h1.name if rank < 2 else h2.name
        assert line == f"[{host}:{rank}] sum=10 rank={rank} host={host} local={rank % 2} ifname=eth0"


@pytest.mark.timeout(240)
def test_the_rank_that_raised_is_named_across_hosts(ns_cluster, ssh_home, tmp_path):
    """Rank 0 (first host) raises while rank 1 (second host) waits in a collective: its
    agent reports the exception as it happens, so the head names rank 0, not the peer."""
    from pathlib import Path

    env, _ = ssh_home
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.name} slots=1", f"{h2.name} slots=1"])
    worker = str(repo_paths.WORKERS / "raise_in_collective.py")
    res = _run(["--hostfile", hf, "--master_port", "0", worker, "zero2"], env, tmp_path, timeout=200)
    assert res.returncode == 1, res.stderr
    assert f"dslaunch: {h1.name}:0 failed first: exited with code 1" in res.stderr
    assert f"[{h1.name}:0] RuntimeError: rank 0 broke on purpose" in res.stderr
    assert "Connection closed by peer" not in res.stderr, res.stderr


@pytest.mark.timeout(90)
def test_remote_worker_failure_tears_down_every_host(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.ip} slots=2", f"{h2.ip} slots=2"])
    script = _script(tmp_path, "fail.py", """
        import os, sys, time
        print("pid", os.getpid(), flush=True)
        if os.environ["RANK"] == "3":
            time.sleep(1.0)
            print("rank 3 is about to fail", file=sys.stderr, flush=True)
            sys.exit(7)
        time.sleep(120)
    """)
    t0 = time.monotonic()
    res = _run(["--hostfile", hf, "--kill_grace", "2", "--no_local_rank", script], env, tmp_path)
    took = time.monotonic() - t0
    pids = [int(line.split()[-1]) for line in res.stdout.splitlines() if " pid " in line]
    assert len(pids) == 4, res.stdout + res.stderr
    assert res.returncode == 7, res.stderr
    # the failing rank's own line (stderr stays stderr), then one summary naming host and rank
    assert res.stderr.index(f"[{h2.ip}:3] rank 3 is about to fail") < res.stderr.index(
        f"dslaunch: {h2.ip}:3 failed first: exited with code 7")
    assert "dslaunch: stopped the other 3 of 4 worker(s)" in res.stderr
    assert not _wait_gone(pids, 0.5)
    assert took < 20, took
    assert not _only_sshd_left(ns_cluster)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_signal_to_head_leaves_no_orphans_on_any_host(ns_cluster, ssh_home, tmp_path, sig):
    env, _ = ssh_home
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.ip} slots=2", f"{h2.ip} slots=2"])
    script = _script(tmp_path, "sleep.py", """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(120)
    """)
    head = subprocess.Popen(DSLAUNCH + ["--hostfile", hf, "--kill_grace", "2", "--no_local_rank", script],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = []
        deadline = time.monotonic() + 60
        while len(pids) < 4 and time.monotonic() < deadline:
            line = head.stdout.readline()
            if not line:
                break
            if " pid " in line:
                pids.append(int(line.split()[-1]))
        assert len(pids) == 4, head.stderr.read() if head.poll() is not None else pids
        head.send_signal(sig)
        code = head.wait(timeout=30)
        assert code == (130 if sig == signal.SIGINT else -9)
        assert not _wait_gone(pids, 5.0)  # SIGKILL: agents notice the closed channel (stdin EOF)
        assert not _only_sshd_left(ns_cluster)
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()


@pytest.mark.timeout(60)
def test_unreachable_host_is_named_and_nothing_starts(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    hf = _hostfile(tmp_path, [f"{ns_cluster.hosts[0].name} slots=1", f"{ns_cluster.unused_ip} slots=1"])
    script = _script(tmp_path, "never.py", "raise SystemExit('must not run')\n")
    for extra in ([], ["--skip_check"]):
        t0 = time.monotonic()
        res = _run(["--hostfile", hf, "--ssh_timeout", "1", *extra, script], env, tmp_path, timeout=30)
        assert res.returncode != 0 and time.monotonic() - t0 < 15
        # the first try times out; after it the kernel remembers the failed ARP and says so at once
        ip = re.escape(ns_cluster.unused_ip)
        assert re.search(rf"{ip}(: | \().*{ip}:22:? "
                         r"(timed out after 1s|.*No route to host)", res.stderr), res.stderr
        assert "must not run" not in res.stdout + res.stderr
        assert "Traceback" not in res.stderr
    assert not _only_sshd_left(ns_cluster)


@pytest.mark.timeout(60)
def test_wrong_and_unknown_host_keys(ns_cluster, ssh_home, tmp_path):
    env, home = ssh_home
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.ip} slots=1", f"{h2.ip} slots=1"])
    script = _script(tmp_path, "hi.py", "import os; print('hi', os.environ['RANK'])\n")
    kh = home / ".ssh" / "known_hosts"
    good = kh.read_text()
    other = tmp_path / "k"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    kh.write_text("".join(line + "\n" for line in good.splitlines() if not line.startswith(h2.ip))
                  + f"{h2.ip} {wrong}\n")
    for extra in ([], ["--skip_check"], ["--accept_new_host_keys", "--skip_check"]):
        res = _run(["--hostfile", hf, "--no_local_rank", *extra, script], env, tmp_path)
        assert res.returncode != 0
        # the preflight names it in its summary, the launch itself as "host: message"
        assert f"{h2.ip} (HOST KEY MISMATCH" in res.stderr or f"{h2.ip}: HOST KEY MISMATCH" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
        assert "hi" not in res.stdout
    kh.write_text("".join(line + "\n" for line in good.splitlines() if not line.startswith(h2.ip)))
    res = _run(["--hostfile", hf, "--no_local_rank", "--skip_check", script], env, tmp_path)
    assert res.returncode != 0 and "--accept_new_host_keys" in res.stderr and f"{h2.ip}: host key" in res.stderr
    res = _run(["--hostfile", hf, "--no_local_rank", "--accept_new_host_keys", script], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == [f"[{h1.ip}:0] hi 0", f"[{h2.ip}:1] hi 1"]
    assert h2.ip in kh.read_text()


TRICKY = ["plain", "with space", "'single'", '"double"', "$HOME", "a;b", "`id`", "ünï©ødé ✓", "", "--local_rank=9",
          "back\\slash", "new\nline", "*", "%n %h"]


@pytest.mark.timeout(90)
def test_arguments_and_env_arrive_byte_identical_and_secrets_are_masked(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    env["NCCL_TRICKY"] = "a b;$x 'q'"
    env["MY_VAR"] = "exported ✓"
    env["NOT_FORWARDED"] = "nope"
    (tmp_path / ".dslaunch_env").write_text('HF_TOKEN=hf_secret_123\nFROM_FILE="x y"\n')
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.name} slots=1", f"{h2.name} slots=1"])
    script = _script(tmp_path, "echo.py", """
        import json, os, sys
        keys = ["NCCL_TRICKY", "MY_VAR", "NOT_FORWARDED", "HF_TOKEN", "FROM_FILE", "RANK", "DSLAUNCH_ACCELERATOR"]
        with open(f"out-{os.environ['RANK']}.json", "w") as f:
            json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "cwd": os.getcwd()}, f)
    """)
    res = _run(["--hostfile", hf, "--export", "MY_VAR", script, *TRICKY], env, tmp_path)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out-{rank}.json").read_text())
        assert got["argv"] == [f"--local_rank=0", *TRICKY]
        assert got["env"] == {"NCCL_TRICKY": "a b;$x 'q'", "MY_VAR": "exported ✓", "NOT_FORWARDED": None,
                              "HF_TOKEN": "hf_secret_123", "FROM_FILE": "x y", "RANK": str(rank),
                              "DSLAUNCH_ACCELERATOR": "cpu"}
        assert got["cwd"] == str(tmp_path)  # the head's working directory
    assert "hf_secret_123" not in res.stdout + res.stderr

    dry = _run(["--hostfile", hf, "--export", "MY_VAR", "--dry_run", script, *TRICKY], env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    # HF_TOKEN hidden (an env file's value, and a secret-looking name); forwarded non-secrets shown
    assert "HF_TOKEN=***" in dry.stdout and "FROM_FILE=***" in dry.stdout
    assert "NCCL_TRICKY='a b;$x '\"'\"'q'\"'\"''" in dry.stdout and "MY_VAR='exported ✓'" in dry.stdout
    assert "hf_secret_123" not in dry.stdout + dry.stderr
    assert f"env file {tmp_path / '.dslaunch_env'} sets HF_TOKEN, FROM_FILE for every worker" in dry.stderr
    shown = _run(["--hostfile", hf, "--export", "MY_VAR", "--dry_run", "--show_env", script], env, tmp_path)
    assert "HF_TOKEN=hf_secret_123" in shown.stdout


@pytest.mark.timeout(90)
def test_max_restarts_restarts_every_node(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.ip} slots=1", f"{h2.ip} slots=1"])
    script = _script(tmp_path, "flaky.py", """
        import os, sys
        n = os.environ["DSLAUNCH_RESTART_COUNT"]
        print("attempt", n, "rank", os.environ["RANK"], flush=True)
        sys.exit(5 if (n == "0" and os.environ["RANK"] == "1") else 0)
    """)
    res = _run(["--hostfile", hf, "--max_restarts", "1", "--no_local_rank", "--skip_check",
                "--log_dir", str(tmp_path / "logs"), script], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"[{h2.ip}:1] attempt 1 rank 1" in res.stdout and f"[{h1.ip}:0] attempt 1 rank 0" in res.stdout
    # --log_dir: the head writes every rank's lines, remote ones included
    log1 = (tmp_path / "logs" / "rank_1.log").read_text().splitlines()
    assert log1[0].startswith("=== dslaunch run ") and log1[0].endswith(" restart 0 ===")
    assert log1[1:] == ["attempt 0 rank 1", log1[2], "attempt 1 rank 1"] and log1[2].endswith(" restart 1 ===")
    assert "restarting every worker (restart 1 of 1)" in res.stderr


@pytest.mark.timeout(90)
def test_pdsh_launcher_for_real(ns_cluster, ssh_home, tmp_path):
    env, home = ssh_home
    h1, h2 = ns_cluster.hosts
    # pdsh runs the system ssh, which reads the passwd home's ~/.ssh, not $HOME's: pass ours explicitly
    env["PDSH_SSH_ARGS_APPEND"] = f"-o UserKnownHostsFile={home}/.ssh/known_hosts -o LogLevel=ERROR"
    hf = _hostfile(tmp_path, [f"{h1.ip} slots=2", f"{h2.ip} slots=1"])
    script = _script(tmp_path, "hi.py", """
        import os, socket, sys
        print("hi", os.environ["RANK"], os.environ["LOCAL_RANK"], socket.gethostname(), sys.argv[1:], flush=True)
        sys.exit(4 if sys.argv[1:] == ["fail"] and os.environ["RANK"] == "2" else 0)
    """)
    common = ["--hostfile", hf, "--launcher", "pdsh", "--ssh_key", str(home / ".ssh" / "id_ed25519"),
              "--no_local_rank", "--skip_check"]
    res = _run([*common, script, "a b", "%n"], env, tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(line for line in res.stdout.splitlines() if " hi " in line) == [
        f"[{h1.ip}:0] hi 0 0 {h1.name} ['a b', '%n']",
        f"[{h1.ip}:1] hi 1 1 {h1.name} ['a b', '%n']",
        f"[{h2.ip}:2] hi 2 0 {h2.name} ['a b', '%n']",
    ]
    res = _run([*common, script, "fail"], env, tmp_path)
    assert res.returncode == 4 and f"dslaunch: {h2.ip}:2 failed first" in res.stderr
    assert not _only_sshd_left(ns_cluster)

    # SIGKILL to the head: pdsh dies with it, and the agents notice through their heartbeat
    sleeper = _script(tmp_path, "sleep.py", """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(120)
    """)
    (tmp_path / ".dslaunch_env").write_text("HF_TOKEN=hf_pdsh_secret\n")
    head = subprocess.Popen(DSLAUNCH + [*common, "--kill_grace", "1", "--export", "MYPASS=hunter2", sleeper],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(head.stdout.readline().split()[-1]) for _ in range(3)]
        # the plan (secrets included) went through 0600 files, already read and removed, not argv
        leaked = []
        for p in psutil.process_iter(["cmdline", "ppid"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if p.pid == head.pid or (p.info["ppid"] == head.pid and p.info["cmdline"] == head.args):
                continue  # the user's own command line is theirs (and the job process's, forked from it)
            if "hf_pdsh_secret" in cmd or "hunter2" in cmd or "--plan" in cmd:
                leaked.append(cmd)
        assert not leaked
        request_dir = tmp_path / ".dslaunch"
        assert request_dir.stat().st_mode & 0o777 == 0o700 and not list(request_dir.iterdir())
        head.kill()
        head.wait()
        assert not _wait_gone(pids, 10.0)
        assert not _only_sshd_left(ns_cluster)
    finally:
        if head.poll() is None:
            head.kill()


@pytest.mark.timeout(60)
def test_local_and_remote_hosts_in_one_job_with_workdir(ns_cluster, ssh_home, tmp_path):
    env, _ = ssh_home
    h1 = ns_cluster.hosts[0]
    work = tmp_path / "elsewhere"
    work.mkdir()
    hf = _hostfile(tmp_path, ["localhost slots=1", f"{h1.name} slots=1"])
    script = _script(tmp_path, "where.py", """
        import os, socket
        print("at", os.environ["RANK"], socket.gethostname(), os.getcwd(), flush=True)
    """)
    res = _run(["--hostfile", hf, "--master_addr", ns_cluster.root_ip, "--workdir", str(work),
                "--no_local_rank", script], env, tmp_path)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in res.stdout.splitlines() if " at " in line)
    import socket
    assert lines == sorted([f"[localhost:0] at 0 {socket.gethostname()} {work}", f"[{h1.name}:1] at 1 {h1.name} {work}"])


def _job_processes(tb):
    """Processes in the host namespaces other than sshd (listeners and their sessions)."""
    out = []
    for pid in tb.host_pids():
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if cmd and not cmd[0].startswith(("sshd", "/usr/sbin/sshd")):
            out.append(" ".join(cmd))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_link_down_is_a_lost_host_and_both_sides_stop(ns_cluster, ssh_home, tmp_path, launcher):
    """`ip link set <veth> down` on one host mid-job: the head names it lost and exits within
    --heartbeat_timeout + 5 s; that host's agent, missing the head's pings as long, kills its
    workers; once the link is back no process of the job is left on either host."""
    env, home = ssh_home
    extra = ["--launcher", "pdsh", "--ssh_key", str(home / ".ssh" / "id_ed25519"), "--skip_check"] if launcher == "pdsh" else []
    env["PDSH_SSH_ARGS_APPEND"] = f"-o UserKnownHostsFile={home}/.ssh/known_hosts -o LogLevel=ERROR"
    h1, h2 = ns_cluster.hosts
    hf = _hostfile(tmp_path, [f"{h1.ip} slots=1", f"{h2.ip} slots=1"])
    script = _script(tmp_path, "sleep.py", """
        import os, time
        print("pid", os.getpid(), flush=True)
        time.sleep(120)
    """)
    timeout = 5
    head = subprocess.Popen(DSLAUNCH + ["--hostfile", hf, "--kill_grace", "1", "--heartbeat_timeout", str(timeout),
                                        *extra, "--no_local_rank", script], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    link_down = False
    try:
        pids = [int(head.stdout.readline().split()[-1]) for _ in range(2)]
        subprocess.run(["ip", "link", "set", "dev", h2.veth, "down"], check=True)
        link_down = True
        t0 = time.monotonic()
        code = head.wait(timeout=timeout + 5)
        took = time.monotonic() - t0
        err = head.stderr.read()
        assert code == 255, err
        assert f"dslaunch: {h2.ip} failed first: lost: nothing from its agent for " in err, err
        assert took < timeout + 5
        assert not _wait_gone(pids[:1], 5)  # the reachable host was stopped by the head
        # the cut-off host's agent killed its worker by itself, while the link was still down
        assert not _wait_gone(pids[1:], t0 + timeout + 5 - time.monotonic() + 1)
        subprocess.run(["ip", "link", "set", "dev", h2.veth, "up"], check=True)
        link_down = False
        deadline = time.monotonic() + 15
        while _job_processes(ns_cluster) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _job_processes(ns_cluster)
    finally:
        if link_down:
            subprocess.run(["ip", "link", "set", "dev", h2.veth, "up"])
        if head.poll() is None:
            head.kill()
            head.wait()
