"""What users coming from DeepSpeed's launcher and from torchrun expect, through the CLI.

The first part replays every case of DeepSpeed's own launcher unit tests
(tests/unit/launcher/test_run.py: parse_resource_filter, parse_inclusion_exclusion, the
CUDA_VISIBLE_DEVICES resolution, --num_nodes/--num_gpus with -i/-e, hostfile parsing)
through `dslaunch --dry_run --json`: the slots each host runs on, or a usage error (one
line, exit 2) where DeepSpeed raises. Where DeepSpeed's filter returns an empty pool,
there is nothing to launch, which is an error here too.
"""
import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dslaunch.launcher import machine
from dslaunch.launcher.cli import launch
import repo_paths
from dist_harness import DSLAUNCH

BEHAVE = str(repo_paths.WORKERS / "behave.py")
ONE = "worker-0 slots=4\n"
TWO = "worker-0 slots=4\nworker-1 slots=4\n"


def cli(args, tmp_path, hostfile=None, env=None):
    if hostfile is not None:
        (tmp_path / "hosts").write_text(textwrap.dedent(hostfile))
        args = ["-H", str(tmp_path / "hosts"), *args]
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = CliRunner().invoke(launch, ["--dry_run", "--json", *args, BEHAVE],
                               env={"HOME": str(tmp_path), **(env or {})}, prog_name="dslaunch")
    finally:
        os.chdir(old)
    return r.exit_code, r.stdout, r.stderr


def slots(args, tmp_path, hostfile=None, env=None):
    code, out, err = cli(args, tmp_path, hostfile, env)
    assert code == 0, err
    return {n["host"]: n["slots"] for n in json.loads(out)["nodes"]}


def refused(args, tmp_path, hostfile=None):
    code, out, err = cli(args, tmp_path, hostfile)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


ALL = [0, 1, 2, 3]


# ---------------------------------------------------------------- DeepSpeed's test_run.py, replayed

def test_parser_mutual_exclusive(tmp_path):
    assert "--include and --exclude cannot be used together" in refused(["-i", "worker-0", "-e", "worker-0:1"], tmp_path, ONE)


@pytest.mark.parametrize("args, expected", [
    ([], {"worker-0": ALL}),
    (["-e", "worker-0:1"], {"worker-0": [0, 2, 3]}),
    (["-e", "worker-0:1,2"], {"worker-0": [0, 3]}),
    (["-i", "worker-0:1"], {"worker-0": [1]}),
    (["-i", "worker-0:1,1"], {"worker-0": [1]}),  # including slots multiple times does not break things
    (["-i", "worker-0:1@worker-0:0,1"], {"worker-0": [0, 1]}),
    (["-i", "worker-0"], {"worker-0": ALL}),  # a bare host means all of its slots
    (["--include", "worker-0"], {"worker-0": ALL}),
])
def test_parser_local(tmp_path, args, expected):
    assert slots(args, tmp_path, ONE) == expected


@pytest.mark.parametrize("args", [["-e", "worker-0"], ["-e", "worker-0:0,1,2,3"]])
def test_parser_local_excluding_everything(tmp_path, args):
    assert "no slots left to run on" in refused(args, tmp_path, ONE)


@pytest.mark.parametrize("args, expected", [
    ([], {"worker-0": ALL, "worker-1": ALL}),
    (["-i", "worker-1:0,3"], {"worker-1": [0, 3]}),
    (["-e", "worker-1"], {"worker-0": ALL}),
    (["-e", "worker-0:0,1@worker-1:3"], {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
])
def test_parser_multinode(tmp_path, args, expected):
    assert slots(args, tmp_path, TWO) == expected


@pytest.mark.parametrize("args, expected", [
    ([], {"worker-0": ALL, "worker-1": ALL}),
    (["-i", "worker-0"], {"worker-0": ALL}),
    (["-i", "worker-0@worker-1:0,2"], {"worker-0": ALL, "worker-1": [0, 2]}),
    (["-i", "worker-1:0,2"], {"worker-1": [0, 2]}),
    (["-e", "worker-0:1"], {"worker-0": [0, 2, 3], "worker-1": ALL}),
])
def test_parse_inclusion_exclusion(tmp_path, args, expected):
    assert slots(args, tmp_path, TWO) == expected


@pytest.mark.parametrize("option", ["-i", "-e"])
@pytest.mark.parametrize("spec", ["worker-0:4", "worker-0:99", "worker-0:0,4"])
def test_parse_inclusion_exclusion_errors(tmp_path, option, spec):
    assert "has no slot" in refused([option, spec], tmp_path, ONE)


def test_parse_inclusion_exclusion_unknown_host(tmp_path):
    assert "unknown host 'jeff'" in refused(["-i", "jeff"], tmp_path, ONE)


def test_visible_devices_resolve_to_the_requested_slots(tmp_path, monkeypatch):
    """CUDA_VISIBLE_DEVICES=0,2 on a 4-GPU machine launches on devices 0 and 2 (DeepSpeed turns the
    mask into --include localhost:0,2; here slot i is the i-th visible device)."""
    driver = tmp_path / "gpus"
    for bus in range(4):
        (driver / f"0000:0{bus}:00.0").mkdir(parents=True)
    real = machine.detect_gpus
    monkeypatch.setattr(machine, "detect_gpus", lambda env, **kw: real(env, driver_dir=str(driver), dev_dir="/none"))
    code, out, err = cli([], tmp_path, env={"CUDA_VISIBLE_DEVICES": "0,2"})
    assert code == 0, err
    node = json.loads(out)["nodes"][0]
    assert node["accelerator"] == "cuda" and [w["rank"] for w in node["workers"]] == [0, 1]
    assert {w["env"]["CUDA_VISIBLE_DEVICES"] for w in node["workers"]} == {"0,2"}


@pytest.mark.parametrize("option, spec", [
    ("-i", "jeff"), ("-e", "jeff"),  # host does not exist
    ("-i", "worker-1:4"), ("-e", "worker-1:4"),  # slot does not exist
    ("-e", "worker-1@worker-0:1@5"),  # formatting
])
def test_parser_errors(tmp_path, option, spec):
    refused([option, spec], tmp_path, TWO)


@pytest.mark.parametrize("args", [
    "--num_nodes 1 -i localhost", "--num_nodes 1 --num_gpus 1 -i localhost", "--num_gpus 1 -i localhost",
    "--num_nodes 1 -e localhost", "--num_nodes 1 --num_gpus 1 -e localhost", "--num_gpus 1 -e localhost",
])
def test_num_plus_parser(tmp_path, args):
    assert "cannot be combined with --num_" in refused(args.split(), tmp_path)


def test_hostfile_good(tmp_path):
    hostfile = """
    worker-1 slots=2
    worker-2 slots=2

    localhost slots=1
    123.23.12.10 slots=2

    #worker-1 slots=3
    # this is a comment

    """
    assert slots([], tmp_path, hostfile) == {"worker-1": [0, 1], "worker-2": [0, 1], "localhost": [0],
                                              "123.23.12.10": [0, 1]}


@pytest.mark.parametrize("hostfile, message", [
    ("worker-1 slots=2\nworker-2 slots=1\nworker-1 slots=1\n", "duplicate host 'worker-1'"),
    ("this is bad slots=1\n", "expected 'slots=N' after the host, got 'is'"),
    ("missingslots\n", "host 'missingslots' has no slots=N"),
    ("\n", "hostfile lists no hosts"),
    ("worker-1 slots=2\nthis is bad slots=1\nworker-2 slots=4\nmissingslots\n\n", "hosts:2: expected 'slots=N'"),
])
def test_hostfiles_bad(tmp_path, hostfile, message):
    assert message in refused([], tmp_path, hostfile)


# ---------------------------------------------------------------- other DeepSpeed launcher options

def test_deepspeed_spellings(tmp_path):
    code, out, err = cli(["--num_accelerators", "2", "--enable_each_rank_log", "logs", "--no_ssh_check"], tmp_path)
    plan = json.loads(out)
    assert code == 0 and plan["world_size"] == 2 and plan["log_dir"] == "logs"


def test_force_multi_sends_even_this_machine_through_the_launcher(tmp_path):
    code, out, err = cli(["--force_multi"], tmp_path, "localhost slots=2\n")
    plan = json.loads(out)
    assert code == 0 and plan["launcher"] == "ssh" and plan["nodes"][0]["local"] is False
    assert plan["backend"]["agents"]["localhost"].endswith("-m dslaunch.launcher.agent")


@pytest.mark.parametrize("args, message", [
    (["--autotuning_budget", "60"], "--autotuning_budget needs --autotuning tune|run"),
    (["--autotuning_repeats", "2"], "--autotuning_repeats needs --autotuning tune|run"),
    (["--elastic_training"], "--min_nodes: an elastic job needs a --hostfile listing its hosts"),
    (["--nnodes", "1:x"], "--nnodes 1:x: expected MIN:MAX, two whole numbers"),
    (["--no_ssh"], "--no_ssh: dslaunch starts the other nodes itself"),
    (["--bind_cores_to_rank", "--bind_core_list", "0", "--num_gpus", "2"],
     "--bind_cores_to_rank: 1 core(s) cannot give each of 2 local ranks one of its own"),
])
def test_refused_with_a_reason(tmp_path, args, message):
    assert message in refused(args, tmp_path)


def test_bind_cores_plan(tmp_path):
    code, out, err = cli(["--num_gpus", "2", "--bind_cores_to_rank", "--bind_core_list", "0,1"], tmp_path)
    workers = json.loads(out)["nodes"][0]["workers"]
    assert [(w["cpus"], w["env"]["OMP_NUM_THREADS"]) for w in workers] == [([0], "1"), ([1], "1")]


@pytest.mark.timeout(60)
def test_bind_cores_pins_every_thread_and_save_pid(tmp_path):
    """A real launch: each rank (and a thread it starts later) runs only on its core; --save_pid
    leaves /tmp/<pid>.deepspeed while the job runs and removes it after."""
    script = tmp_path / "where.py"
    script.write_text(textwrap.dedent("""
        import os, sys, threading, time
        seen = {}
        t = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))
        t.start(); t.join()
        print(os.environ["RANK"], sorted(os.sched_getaffinity(0)), seen["thread"], os.environ["OMP_NUM_THREADS"],
              os.path.exists(f"/tmp/{os.getppid()}.deepspeed"), flush=True)
    """))
    cores = sorted(os.sched_getaffinity(0))[:2]  # the CPUs this test may use (2 on the CI box)
    r = subprocess.run([*DSLAUNCH, "--num_gpus", str(len(cores)), "--bind_cores_to_rank", "--bind_core_list",
                        ",".join(map(str, cores)), "--save_pid", "--no_local_rank", str(script)],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f"[rank {i}] {i} [{c}] [{c}] 1 True" for i, c in enumerate(cores)]
    assert "dslaunch: launcher pid: " in r.stderr
    pid = r.stderr.split("launcher pid: ")[1].split()[0]
    assert not Path(f"/tmp/{pid}.deepspeed").exists()


# ---------------------------------------------------------------- torchrun spellings, --help, --version

def test_torchrun_spellings(tmp_path):
    for spelling in ("--nproc_per_node", "--nproc-per-node"):
        assert json.loads(cli([spelling, "3"], tmp_path)[1])["world_size"] == 3
    from dist_harness import free_port

    port = free_port()  # a dry run refuses a port in use on this machine: no fixed one
    code, out, err = cli(["--master-port", str(port), "--master-addr", "127.0.0.2"], tmp_path)
    assert (json.loads(out)["master_port"], json.loads(out)["master_addr"]) == (port, "127.0.0.2")
    assert json.loads(cli(["--standalone"], tmp_path)[1])["master_port"] != 29500  # a free port
    assert "--standalone means this machine only" in refused(["--standalone"], tmp_path, ONE)
    assert "--nnodes: dslaunch starts every node from one machine" in refused(["--nnodes", "2"], tmp_path)
    assert "--node_rank: node ranks follow the hostfile order" in refused(["--node_rank=1"], tmp_path)


def test_help_lists_subcommands_and_examples_and_version():
    r = subprocess.run([*DSLAUNCH, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    help_text = r.stdout
    for word in ("check", "consolidate", "build-ops"):
        (line,) = [ln for ln in help_text.splitlines() if ln.strip().startswith(word + " ")]
        assert len(line.split()) > 3  # the word and a one-line description
    examples = help_text.split("Examples:")[1]
    assert examples.count("dslaunch ") >= 2
    r = subprocess.run([*DSLAUNCH, "--version"], capture_output=True, text=True, timeout=30)
    from importlib.metadata import version
    assert r.returncode == 0 and r.stdout.strip() == f"dslaunch {version('dslaunch')}"
