"""The dslaunch command end to end: options, environment, plan, pass-through, env contract."""
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from dslaunch.launcher.cli import launch
import repo_paths
from dist_harness import DSLAUNCH

ROOT = repo_paths.ROOT
BEHAVE = str(repo_paths.WORKERS / "behave.py")


def cli(args, env=None, cwd=None):
    """In-process run (fast) for everything that starts no worker."""
    runner = CliRunner()
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        r = runner.invoke(launch, args, env=env, prog_name="dslaunch")
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


def plan(args, env=None, cwd=None):
    code, out, err = cli(["--dry_run", "--json", *args], env=env, cwd=cwd)
    assert code == 0, err
    return json.loads(out)


def run(args, timeout=60, **kw):
    return subprocess.run([*DSLAUNCH, *args], capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture
def hostfile(tmp_path):
    def make(text):
        p = tmp_path / "hosts"
        p.write_text(text)
        return str(p)

    return make


# ---------------------------------------------------------------- plan and options (in-process)

def test_cpu_default_is_one_worker_and_num_gpus_counts_processes():
    p = plan([BEHAVE])
    assert p["world_size"] == 1 and p["nodes"][0]["accelerator"] == "cpu"
    p = plan(["--num_gpus", "3", BEHAVE])
    assert [w["rank"] for w in p["nodes"][0]["workers"]] == [0, 1, 2]
    code, out, err = cli(["--dry_run", "--num_gpus", "3", BEHAVE])
    assert err.count("no GPU on this machine: --num_gpus counts worker processes; running 3 on the CPU") == 1


def test_multi_host_dry_run_plan(hostfile):
    hf = hostfile("localhost slots=2\nbob@far-away slots=3\n")
    p = plan(["--hostfile", hf, "--exclude", "far-away:1", BEHAVE, "ok"])
    assert p["world_size"] == 4 and p["master_addr"] == "localhost"
    local, remote = p["nodes"]
    assert (local["local"], remote["local"], remote["user"]) == (True, False, "bob")
    assert remote["slots"] == [0, 2] and remote["ranks"] == [2, 3]
    w = remote["workers"][1]
    assert (w["env"]["RANK"], w["env"]["LOCAL_RANK"], w["env"]["NODE_RANK"], w["env"]["CUDA_VISIBLE_DEVICES"]) == ("3", "1", "1", "0,2")
    assert w["argv"][-2:] == ["--local_rank=1", "ok"]
    code, out, err = cli(["--dry_run", "--hostfile", hf, BEHAVE])
    assert code == 0 and "far-away" in out and "world size 5" in out


def test_local_hostfile_text_plan(hostfile):
    code, out, err = cli(["--dry_run", "--hostfile", hostfile("localhost slots=3\n"), "--include", "localhost:0,2", BEHAVE])
    assert code == 0, err
    assert "node 0: localhost (this machine, cpu) slots 0,2 ranks 0-1" in out
    assert "CUDA_VISIBLE_DEVICES" not in out and "--local_rank=1" in out  # CPU workers: slots are no devices
    # only a hostfile sized the job: the notice does not speak of --num_gpus
    assert "no GPU on this machine: its hostfile slots are worker processes; running 2 on the CPU" in err
    assert "--num_gpus" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hostfile", "/nonexistent/hosts", "x.py"], "dslaunch: error: /nonexistent/hosts: hostfile not found"),
        (["--hostfile", "HF", "x.py"], "dslaunch: error: HF:2: slots=4x is not a whole number"),
        (["--hostfile", "GOOD", "--include", "w9", "x.py"], "unknown host 'w9'"),
        (["--hostfile", "GOOD", "--include", "localhost:7", "x.py"], "host 'localhost' has no slot 7"),
        (["--hostfile", "GOOD", "--include", "localhost", "--exclude", "localhost:0", "x.py"], "--include and --exclude cannot"),
        (["--hostfile", "GOOD", "--num_gpus", "3", "x.py"], "--num_gpus 3: host 'localhost' has only slots=2 (GOOD:1)"),
        (["--num_nodes", "2", "x.py"], "--num_nodes 2 needs a --hostfile"),
        (["--num_gpus", "0", "x.py"], "--num_gpus 0: must be between 1 and 1024"),
        (["--num_gpus", "two", "x.py"], "dslaunch: error: Invalid value for '--num_gpus'"),
        (["--bogus", "x.py"], "dslaunch: error: No such option"),
        ([], "dslaunch: error: Missing argument 'SCRIPT'"),
        (["--master_port", "70000", "x.py"], "--master_port 70000: not a TCP port"),
        (["--json", "x.py"], "--json only applies to --dry_run"),
        (["--module", "--no_python", "x"], "--module and --no_python cannot be used together"),
        (["missing.py"], "dslaunch: error: missing.py: no such script"),
        (["--no_python", "no-such-program-xyz"], "no-such-program-xyz: program not found on PATH"),
        (["--env_file", "/nonexistent/envf", BEHAVE], "/nonexistent/envf: env file"),
        # bad values: one line, exit 2, nothing started
        (["--kill_grace", "nan", BEHAVE], "--kill_grace nan: must be a finite number of seconds"),
        (["--kill_grace", "inf", BEHAVE], "--kill_grace inf: must be a finite number of seconds"),
        (["--kill_grace", "-1", BEHAVE], "--kill_grace -1: must be 0 or more"),
        (["--heartbeat_timeout", "0", BEHAVE], "--heartbeat_timeout 0: must be 1 or more"),
        (["--num_gpus", "100000000", BEHAVE], "--num_gpus 100000000: must be between 1 and 1024"),
        (["--hostfile", "HUGE", BEHAVE], "HUGE:1: slots=100000000: more than 1024 slots on one host"),
        (["--hostfile", "HUGER", BEHAVE], "HUGER:1: slots=100000000000000000000: more than 1024 slots on one host"),
        (["--hostfile", "EXP", BEHAVE], "EXP:1: slots=1e20 is not a whole number"),
        (["--env_file", "NUL", BEHAVE], "NUL:2: contains a NUL byte, which no environment variable can hold"),
        (["--log_dir", "x.py/logs", BEHAVE], "--log_dir x.py/logs: cannot write there (Not a directory)"),
        (["--bind_core_list", "0-1", BEHAVE], "--bind_core_list needs --bind_cores_to_rank"),
        (["--bind_cores_to_rank", "--bind_core_list", "3-1", BEHAVE], "--bind_core_list '3-1': range '3-1' runs backwards"),
        # unbounded input: refused by name at once, never read until memory runs out or forever
        (["--bind_cores_to_rank", "--bind_core_list", "0-100000000", BEHAVE],
         "--bind_core_list '0-100000000': core 100000000 is beyond 8191, the highest CPU number Linux can have"),
        (["-H", "/dev/zero", BEHAVE], "/dev/zero: hostfile is a character device, not a regular file"),
        (["--hostfile", "FIFO", BEHAVE], "FIFO: hostfile is a FIFO, not a regular file"),
        (["--hostfile", "BIG", BEHAVE], "BIG: hostfile is 16777217 bytes, over its limit of 16 MiB"),
        (["--env_file", "/dev/zero", BEHAVE], "/dev/zero: env file is a character device, not a regular file"),
        (["--env_file", "FIFO", BEHAVE], "FIFO: env file is a FIFO, not a regular file"),
    ],
)
@pytest.mark.timeout(60)
def test_usage_errors_are_one_line_exit_2(tmp_path, args, message):
    os.mkfifo(tmp_path / "FIFO")  # nobody ever writes to it: reading it would wait forever
    with open(tmp_path / "BIG", "wb") as fh:
        fh.truncate((16 << 20) + 1)
    (tmp_path / "HF").write_text("localhost slots=2\nw1 slots=4x\n")
    (tmp_path / "x.py").write_text("")
    (tmp_path / "GOOD").write_text("localhost slots=2\n")
    (tmp_path / "HUGE").write_text("localhost slots=100000000\n")
    (tmp_path / "HUGER").write_text("localhost slots=100000000000000000000\n")
    (tmp_path / "EXP").write_text("localhost slots=1e20\n")
    (tmp_path / "NUL").write_bytes(b"A=1\nB=x\0y\n")
    code, out, err = cli(args, cwd=tmp_path)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("env,message", [
    ({"DSLAUNCH_NUM_GPUS": "abc"}, "DSLAUNCH_NUM_GPUS in the environment (--num_gpus): 'abc' is not a valid integer."),
    ({"DSLAUNCH_KILL_GRACE": "-1"}, "DSLAUNCH_KILL_GRACE in the environment: --kill_grace -1: must be 0 or more"),
    ({"DSLAUNCH_MASTER_PORT": "99999"},
     "DSLAUNCH_MASTER_PORT in the environment: --master_port 99999: not a TCP port (0 picks a free one)"),
])
def test_a_bad_value_from_the_environment_names_the_variable(tmp_path, env, message):
    (tmp_path / "x.py").write_text("")
    code, out, err = cli(["--dry_run", "x.py"], env=env, cwd=tmp_path)
    assert code == 2 and f"dslaunch: error: {message}" in err and len(err.strip().splitlines()) == 1, err
    # the same value typed on the command line: the option is named, as before
    name = next(iter(env)).removeprefix("DSLAUNCH_").lower()
    code, out, err = cli([f"--{name}", env[next(iter(env))], "--dry_run", "x.py"], cwd=tmp_path)
    assert code == 2 and "in the environment" not in err, err


def test_every_option_reads_its_environment_variable_and_the_command_line_wins(monkeypatch):
    """Generic over launch.params, so options added later are covered too."""
    def sample(opt):
        """(env text, command-line text, parsed env value, parsed command-line value)."""
        if isinstance(opt.type, click.Choice):
            a, b = opt.type.choices[-1], opt.type.choices[0]
            return a, b, a, b
        if opt.multiple:
            return "A B", "C", ("A", "B"), ("C",)
        return {click.INT: ("3", "4", 3, 4), click.FLOAT: ("1.5", "2.5", 1.5, 2.5),
                click.STRING: ("env", "cmd", "env", "cmd")}[opt.type]

    code, help_text, _ = cli(["--help"])
    options = [p for p in launch.params if isinstance(p, click.Option) and p.expose_value]
    assert len(options) >= 16
    for opt in options:
        var = f"DSLAUNCH_{opt.name.upper()}"
        assert var in help_text, var
        if opt.is_flag:
            ctx = launch.make_context("dslaunch", ["x.py"])
            assert ctx.params[opt.name] is False
            with monkeypatch.context() as m:
                m.setenv(var, "1")
                assert launch.make_context("dslaunch", ["x.py"]).params[opt.name] is True, var
            continue
        env_text, cmd_text, env_val, cmd_val = sample(opt)
        # monkeypatch puts back what the session set (DSLAUNCH_MASTER_PORT=0, conftest.py)
        with monkeypatch.context() as m:
            m.setenv(var, env_text)
            assert launch.make_context("dslaunch", ["x.py"]).params[opt.name] == env_val, var
            assert launch.make_context("dslaunch", [opt.opts[-1], cmd_text, "x.py"]).params[opt.name] == cmd_val, var


def test_env_var_reaches_the_plan():
    p = plan([BEHAVE], env={"DSLAUNCH_NUM_GPUS": "2", "DSLAUNCH_MAX_RESTARTS": "3"})
    assert p["world_size"] == 2 and p["max_restarts"] == 3
    assert plan(["--num_gpus", "1", BEHAVE], env={"DSLAUNCH_NUM_GPUS": "2"})["world_size"] == 1


def test_env_files_are_named_on_every_launch_and_masked_in_every_dry_run_form(tmp_path):
    (tmp_path / ".dslaunch_env").write_text("HF_TOKEN=hf_secret\nPYTHONPATH=/evil\n")
    (tmp_path / ".deepspeed_env").write_text("WANDB_MODE=offline\n")  # Accelerate writes this one
    env = {"HOME": str(tmp_path / "nohome"), "DB_PASSWORD": "pw"}
    for extra in ([], ["--json"]):
        code, out, err = cli(["--dry_run", *extra, "--export", "MYPASS=hunter2", BEHAVE], env=env, cwd=tmp_path)
        assert code == 0, err
        assert f"dslaunch: env file {tmp_path / '.deepspeed_env'} sets WANDB_MODE for every worker" in err
        assert f"dslaunch: env file {tmp_path / '.dslaunch_env'} sets HF_TOKEN, PYTHONPATH for every worker" in err
        assert not {"hf_secret", "/evil", "hunter2", "offline"} & set(out.replace("=", " ").replace('"', " ").split())
        for shown in (["HF_TOKEN", "***"], ["PYTHONPATH", "***"], ["MYPASS", "***"], ["WANDB_MODE", "***"],
                      ["PYTHONUNBUFFERED", "1"]):
            assert ("=".join(shown) if not extra else '"%s": "%s"' % tuple(shown)) in out
    code, out, err = cli(["--dry_run", "--show_env", BEHAVE], env=env, cwd=tmp_path)
    assert "HF_TOKEN=hf_secret" in out and "WANDB_MODE=offline" in out
    r = run(["--num_gpus", "1", BEHAVE, "ok"], cwd=tmp_path, env=dict(os.environ, **env))
    assert r.returncode == 0 and f"env file {tmp_path / '.dslaunch_env'} sets HF_TOKEN, PYTHONPATH" in r.stderr


def test_master_port_zero_picks_a_free_port():
    port = plan(["--master_port", "0", BEHAVE])["master_port"]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: binding succeeds


def test_modes_module_no_python_no_local_rank():
    w = plan(["-m", "json.tool", "--x"])["nodes"][0]["workers"][0]
    assert w["argv"] == [sys.executable, "-u", "-m", "json.tool", "--local_rank=0", "--x"]
    w = plan(["--no_python", "--no_local_rank", "true", "a"])["nodes"][0]["workers"][0]
    assert w["argv"] == ["true", "a"]


def test_no_torch_on_the_start_up_path(tmp_path):
    """A real 1-worker launch under -X importtime: the launcher process never imports torch."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "dslaunch.launcher", "--num_gpus", "1", BEHAVE, "ok"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    own = [l for l in r.stderr.splitlines() if l.startswith("import time:")]
    assert any("dslaunch.launcher.supervisor" in l for l in own)
    modules = [l.split("|")[-1].strip() for l in own]
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]


# ---------------------------------------------------------------- real runs (subprocess)

WEIRD_ARGS = ["--num_gpus", "3", "-m", "--help", "a b", "'q'", '"dq"', "$HOME", "; rm -rf /", "ünï©ødé", "", "--", "-x=1"]


def test_script_args_pass_through_untouched_and_env_contract(tmp_path):
    (tmp_path / ".dslaunch_env").write_text("FROM_ENV_FILE=yes it is\nRANK=999\n")
    out = tmp_path / "env"
    r = run(["--num_gpus", "2", "--master_port", "0", BEHAVE, "env", str(out), *WEIRD_ARGS], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]
    for rank, g in enumerate(got):
        assert g["argv"][1:] == [f"--local_rank={rank}", "env", str(out), *WEIRD_ARGS]
        e = g["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert (e["NODE_RANK"], e["GROUP_RANK"], e["MASTER_ADDR"]) == ("0", "0", "127.0.0.1")
        assert e.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")  # CPU: none of ours
        assert e["DSLAUNCH_ACCELERATOR"] == "cpu"
        assert e["DSLAUNCH_RESTART_COUNT"] == e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["FROM_ENV_FILE"] == "yes it is"
    assert got[0]["env"]["MASTER_PORT"] == got[1]["env"]["MASTER_PORT"] != "29500"
    assert got[0]["env"]["DSLAUNCH_RUN_ID"] == got[1]["env"]["DSLAUNCH_RUN_ID"]


def test_output_lines_are_prefixed_and_stderr_stays_stderr(tmp_path):
    r = run(["--num_gpus", "2", "--log_dir", str(tmp_path / "logs"), BEHAVE, "lines", "50"])
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        out = [l for l in r.stdout.splitlines() if l.startswith(f"[rank {rank}] ")]
        err = [l for l in r.stderr.splitlines() if l.startswith(f"[rank {rank}] ")]
        assert out == [f"[rank {rank}] r{rank} line {i} end" for i in range(50)] + [f"[rank {rank}] r{rank} no-newline-at-end"]
        assert err == [f"[rank {rank}] Er{rank} Eline {i} Eend" for i in range(50)]
        log = (tmp_path / "logs" / f"rank_{rank}.log").read_text().splitlines()
        assert log[0].startswith("=== dslaunch run ") and len(log) == 1 + 101
    assert "\x1b[" not in r.stdout  # no colours into a pipe


def test_max_restarts_restarts_the_group_with_the_counter_in_env(tmp_path):
    worker = tmp_path / "flaky.py"
    worker.write_text(
        "import os, sys\n"
        "n = int(os.environ['DSLAUNCH_RESTART_COUNT'])\n"
        "print('attempt', n, 'rank', os.environ['RANK'])\n"
        "sys.exit(4 if n < 2 and os.environ['RANK'] == '1' else 0)\n"
    )
    r = run(["--num_gpus", "2", "--max_restarts", "2", "--no_local_rank", str(worker)])
    assert r.returncode == 0, r.stderr
    assert "restarting every worker (restart 1 of 2)" in r.stderr and "(restart 2 of 2)" in r.stderr
    assert "[rank 1] attempt 2 rank 1" in r.stdout
    r = run(["--num_gpus", "2", "--max_restarts", "1", "--no_local_rank", str(worker)])
    assert r.returncode == 4 and "giving up after 1 restart(s)" in r.stderr


@pytest.fixture
def listener():
    """Listen on a TCP port as another job's rendezvous store would: the default 29500 when
    it can be had (when it cannot, something else already listens there), else a free one."""
    import socket

    socks = []

    def listen(port):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            s.close()
            return port
        s.listen()
        socks.append(s)
        return s.getsockname()[1]

    yield listen
    for s in socks:
        s.close()


def test_an_explicit_master_port_in_use_is_one_line_before_anything_starts(listener, tmp_path):
    port = listener(0)
    r = run(["--num_gpus", "2", "--master_port", str(port), BEHAVE, "env", str(tmp_path / "env")])
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == (f"dslaunch: error: --master_port {port}: already in use on this machine "
                                         "(another job?); choose another, or --master_port 0 for a free one")
    assert not list(tmp_path.iterdir())  # no worker started


@pytest.mark.timeout(120)
def test_the_default_port_in_use_moves_to_a_free_one_and_says_so(listener):
    assert listener(29500) == 29500  # held here, or by another job: either way dslaunch moves
    default = {k: v for k, v in os.environ.items() if k != "DSLAUNCH_MASTER_PORT"}  # conftest sets it to 0
    r = run(["--num_gpus", "2", str(ROOT / "scripts" / "examples" / "allreduce.py")], timeout=110, env=default)
    assert r.returncode == 0, r.stderr
    note = [line for line in r.stderr.splitlines() if "port 29500 is in use" in line]
    assert len(note) == 1 and note[0].startswith("dslaunch: port 29500 is in use on this machine (another job?); "
                                                 "using free port "), r.stderr
    assert "(--master_port chooses one)" in note[0] and "[rank 1] all_reduce sum = 3" in r.stdout


@pytest.mark.timeout(120)
def test_gloo_all_reduce_under_dslaunch():
    r = run(["--num_gpus", "2", "--master_port", "0", str(ROOT / "scripts" / "examples" / "allreduce.py")], timeout=110)
    assert r.returncode == 0, r.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] all_reduce sum = 3 (expected 3) on rank {rank} of 2, local rank {rank}" in r.stdout


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "HF: hostfile lists no hosts"),
        ("localhost\n", "HF:1: host 'localhost' has no slots=N"),
        ("# c\nlocalhost slots=0\n", "HF:2: slots=0: a host needs at least 1 slot"),
        ("localhost slots=1\nlocalhost slots=1 # again\n", "HF:2: duplicate host 'localhost' (first listed at HF:1)"),
    ],
)
def test_bad_hostfiles_start_nothing(tmp_path, text, message):
    (tmp_path / "HF").write_text(text)
    r = run(["--hostfile", "HF", BEHAVE, "env", str(tmp_path / "ran")], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == f"dslaunch: error: {message}\n" and r.stdout == ""
    assert not list(tmp_path.glob("ran*"))


def test_module_and_no_python_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(Path(BEHAVE).parent))
    r = run(["--num_gpus", "2", "-m", "behave", "args", "--flag"], env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f'[rank {i}] ["--local_rank={i}", "args", "--flag"]' for i in (0, 1)]
    r = run(["--no_python", "--no_local_rank", "echo", "hi there"])
    assert r.returncode == 0 and r.stdout == "[rank 0] hi there\n"


@pytest.mark.parametrize("how", ["link", "another_user", "file"])
def test_pdsh_never_writes_through_a_request_folder_another_user_planted(tmp_path, how):
    """`.dslaunch` in the working directory is where pdsh's request files go (argv, the control
    token, every .dslaunch_env secret). A planted link, another user's folder or a file there
    is refused in one line before anything is written or started."""
    if how == "another_user" and os.geteuid() != 0:
        pytest.skip("making a folder of another user needs root")
    work, victim, tools = tmp_path / "work", tmp_path / "victim", tmp_path / "bin"
    for d in (work, victim, tools):
        d.mkdir()
    (work / "t.py").write_text("print('hello')\n")
    (work / "hf").write_text("nodeA slots=1\nnodeB slots=1\n")
    (work / ".dslaunch_env").write_text("HF_TOKEN=hf_secret_value\n")
    pdsh = tools / "pdsh"  # stands in for pdsh: records that it was started
    pdsh.write_text(f"#!/bin/sh\ntouch {tmp_path / 'pdsh_ran'}\nexit 1\n")
    pdsh.chmod(0o755)
    if how == "link":
        (work / ".dslaunch").symlink_to(victim)
    elif how == "another_user":
        (work / ".dslaunch").mkdir(mode=0o777)
        os.chmod(work / ".dslaunch", 0o777)
        os.chown(work / ".dslaunch", 65534, 65534)
    else:
        (work / ".dslaunch").write_text("")
    before = victim.stat().st_mtime_ns  # any file made there, even one removed again, moves it
    r = run(["--launcher", "pdsh", "--skip_check", "--hostfile", "hf", "t.py"], cwd=work,
            env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and f"{work}/.dslaunch" in lines[0], r.stderr
    assert {"link": "is a symbolic link", "another_user": "is owned by nobody (uid 65534), not by you",
            "file": "is not a directory"}[how] in lines[0]
    assert victim.stat().st_mtime_ns == before and not list(victim.iterdir())
    assert not (tmp_path / "pdsh_ran").exists()
    if how == "another_user":
        assert not list((work / ".dslaunch").iterdir())


def test_pdsh_request_folder_of_ours_is_made_private(tmp_path):
    """Our own `.dslaunch` left readable by others (an older run, a umask) is made 0700 before use."""
    work, tools = tmp_path / "work", tmp_path / "bin"
    work.mkdir(), tools.mkdir()
    (work / "t.py").write_text("print('hello')\n")
    (work / "hf").write_text("nodeA slots=1\n")
    (work / ".dslaunch").mkdir()
    os.chmod(work / ".dslaunch", 0o755)
    pdsh = tools / "pdsh"
    pdsh.write_text(f"#!/bin/sh\nstat -c %a {work / '.dslaunch'} > {tmp_path / 'mode'}\nexit 1\n")
    pdsh.chmod(0o755)
    run(["--launcher", "pdsh", "--skip_check", "--hostfile", "hf", "--heartbeat_timeout", "2", "t.py"], cwd=work,
        env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"})
    assert (tmp_path / "mode").read_text().strip() == "700"
