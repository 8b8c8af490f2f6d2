"""World layout and env contract: tables of (hosts, filters, counts) -> nodes, and of errors."""
import pytest

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.hostfile import parse_hostfile_text
from dslaunch.launcher.world import (
    Node, RunIdentity, World, contract_keys, layout_world, parse_filter, worker_argv, worker_env,
)

HOSTS = parse_hostfile_text("w0 slots=4\nu@w1 slots=4\nw2 slots=2\n", "hf")


def shape(world):
    return [(n.node_rank, n.host, n.slots, n.first_rank) for n in world.nodes]


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, [(0, "w0", (0, 1, 2, 3), 0), (1, "w1", (0, 1, 2, 3), 4), (2, "w2", (0, 1), 8)]),
        ({"num_nodes": 1}, [(0, "w0", (0, 1, 2, 3), 0)]),
        ({"num_nodes": 2, "num_gpus": 2}, [(0, "w0", (0, 1), 0), (1, "w1", (0, 1), 2)]),
        ({"num_gpus": 1}, [(0, "w0", (0,), 0), (1, "w1", (0,), 1), (2, "w2", (0,), 2)]),
        ({"include": "w1"}, [(0, "w1", (0, 1, 2, 3), 0)]),
        ({"include": "w0@w1:0,2"}, [(0, "w0", (0, 1, 2, 3), 0), (1, "w1", (0, 2), 4)]),
        # include order does not reorder nodes: hostfile order decides node ranks
        ({"include": "w2:1@w0:3"}, [(0, "w0", (3,), 0), (1, "w2", (1,), 1)]),
        ({"include": "w1:2,0"}, [(0, "w1", (0, 2), 0)]),
        ({"exclude": "w1"}, [(0, "w0", (0, 1, 2, 3), 0), (1, "w2", (0, 1), 4)]),
        ({"exclude": "w0:0@w2:1"}, [(0, "w0", (1, 2, 3), 0), (1, "w1", (0, 1, 2, 3), 3), (2, "w2", (0,), 7)]),
        ({"exclude": "w2:0,1"}, [(0, "w0", (0, 1, 2, 3), 0), (1, "w1", (0, 1, 2, 3), 4)]),
        # DeepSpeed merges a host named twice and a slot named twice
        ({"include": "w0:1,1"}, [(0, "w0", (1,), 0)]),
        ({"include": "w0:1@w0:0,1"}, [(0, "w0", (0, 1), 0)]),
        ({"include": "w0@w0:1"}, [(0, "w0", (0, 1, 2, 3), 0)]),  # a bare host is all of it
        ({"exclude": "w0:1@w0:2"}, [(0, "w0", (0, 3), 0), (1, "w1", (0, 1, 2, 3), 2), (2, "w2", (0, 1), 6)]),
    ],
)
def test_layout(kwargs, expected):
    world = layout_world(HOSTS, **kwargs)
    assert shape(world) == expected
    assert world.world_size == sum(len(e[2]) for e in expected)
    assert all(n.user == ("u" if n.host == "w1" else None) for n in world.nodes)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"include": "w0", "exclude": "w1"}, "--include and --exclude cannot be used together"),
        ({"include": "w0", "num_gpus": 1}, "--include cannot be combined with --num_gpus"),
        ({"exclude": "w0", "num_nodes": 1}, "--exclude cannot be combined with --num_nodes"),
        ({"include": "w9"}, "--include 'w9': unknown host 'w9' (known: w0, w1, w2)"),
        ({"exclude": "w2:2"}, "--exclude 'w2:2': host 'w2' has no slot 2 (slots 0-1)"),
        ({"include": "w0:a"}, "--include 'w0:a': slot 'a' of host 'w0' is not a whole number"),
        ({"include": "w0:"}, "--include 'w0:': slot '' of host 'w0' is not a whole number"),
        ({"include": "w0@@w1"}, "--include 'w0@@w1': empty host name"),
        ({"exclude": "w0@w1@w2"}, "--exclude 'w0@w1@w2': no slots left to run on"),
        ({"num_nodes": 4}, "--num_nodes 4: only 3 host(s) available"),
        ({"num_nodes": 0}, "--num_nodes 0: must be at least 1"),
        ({"num_gpus": 3}, "--num_gpus 3: host 'w2' has only slots=2 (hf:3)"),
        ({"num_gpus": 0}, "--num_gpus 0: must be at least 1"),
    ],
)
def test_layout_errors(kwargs, message):
    with pytest.raises(LaunchConfigError) as err:
        layout_world(HOSTS, **kwargs)
    assert message in str(err.value)


def test_parse_filter():
    assert parse_filter("a@b:0,2", "--include") == {"a": None, "b": [0, 2]}
    assert list(parse_filter("b@a", "--include")) == ["b", "a"]


def test_env_contract_uneven_nodes():
    """LOCAL_RANK is the index within the node even when nodes differ in size."""
    world = layout_world(HOSTS, exclude="w0:0,1,2")  # w0 keeps slot 3 only
    ident = RunIdentity("w0", 29500, "run-x", restart_count=2, max_restarts=3)
    envs = [worker_env(world, n, i, ident) for n in world.nodes for i in range(n.local_world_size)]
    assert [e["RANK"] for e in envs] == [str(r) for r in range(7)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "2", "3", "0", "1"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "1", "1", "1", "1", "2", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["1", "4", "4", "4", "4", "2", "2"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3"] + ["0,1,2,3"] * 4 + ["0,1"] * 2
    e = envs[3]
    assert e["WORLD_SIZE"] == "7" and e["GROUP_RANK"] == e["CROSS_RANK"] == "1"
    assert e["GROUP_WORLD_SIZE"] == e["CROSS_SIZE"] == "3" and e["LOCAL_SIZE"] == "4"
    assert e["ROLE_RANK"] == "3" and e["ROLE_WORLD_SIZE"] == "7"
    assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("w0", "29500")
    assert e["DSLAUNCH_RUN_ID"] == e["TORCHELASTIC_RUN_ID"] == "run-x"
    assert e["DSLAUNCH_RESTART_COUNT"] == e["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert e["TORCHELASTIC_MAX_RESTARTS"] == "3" and e["DSLAUNCH_ACCELERATOR"] == "cuda"
    assert "OMP_NUM_THREADS" not in e
    assert set(contract_keys()) == set(e) | {"OMP_NUM_THREADS"}


def test_env_maps_slots_through_inherited_visible_devices():
    world = World((Node(0, "localhost", None, (1, 2), 0),))
    env = worker_env(world, world.nodes[0], 1, RunIdentity("127.0.0.1", 1, "r"), visible_devices=["4", "5", "GPU-abc"],
                     accelerator="cpu", omp_threads=3)
    assert env["CUDA_VISIBLE_DEVICES"] == "5,GPU-abc"
    assert env["DSLAUNCH_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "3"
    with pytest.raises(ValueError):
        worker_env(world, world.nodes[0], 2, RunIdentity("a", 1, "r"))


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, ["py", "-u", "train.py", "--local_rank=3", "--lr", "1e-3"]),
        ({"no_local_rank": True}, ["py", "-u", "train.py", "--lr", "1e-3"]),
        ({"module": True}, ["py", "-u", "-m", "train.py", "--local_rank=3", "--lr", "1e-3"]),
        ({"no_python": True}, ["train.py", "--local_rank=3", "--lr", "1e-3"]),
        ({"no_python": True, "no_local_rank": True}, ["train.py", "--lr", "1e-3"]),
    ],
)
def test_worker_argv(kwargs, expected):
    assert worker_argv("train.py", ["--lr", "1e-3"], 3, python="py", **kwargs) == expected


def test_worker_argv_rejects_module_with_no_python():
    with pytest.raises(LaunchConfigError, match="--module and --no_python"):
        worker_argv("x", [], 0, python="py", module=True, no_python=True)
