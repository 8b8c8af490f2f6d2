"""The multi-process harness itself: results in rank order, a failing rank, a hang caught
by the watchdog with each rank's stack, and ranks forked from warm interpreters seeing what
fresh processes would."""
import os
import sys
import time

import pytest

from dist_harness import DistHang, RankFailed, run_function, run_script


def _rank_and_world():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _rank1_fails():
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom on rank 1")
    time.sleep(60)  # rank 0 would wait forever in a real collective


def _sleeps_forever_in_named_function():
    time.sleep(600)


def _what_a_rank_sees():
    return {"hash": hash("dslaunch"), "cwd": os.getcwd(), "probe": os.environ.get("HARNESS_PROBE"),
            "argv0": os.path.basename(sys.argv[0]), "warm": "torch._dynamo" in sys.modules,
            "own_group": os.getpgid(0) == os.getpid(), "stdin": os.read(0, 1)}


def test_a_forked_rank_sees_its_own_environment_folder_argv_and_session(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen = run_function(_what_a_rank_sees, nprocs=2, init_process_group=False, env={"HARNESS_PROBE": "x"})
    for s in seen:
        assert s["warm"] and s["own_group"], s
        assert (s["cwd"], s["probe"], s["argv0"], s["stdin"]) == (str(tmp_path), "x", "dist_harness.py", b""), s
    if "PYTHONHASHSEED" not in os.environ:  # one warm interpreter per rank number: each its own hash seed
        assert seen[0]["hash"] != seen[1]["hash"]
    assert run_function(_what_a_rank_sees, nprocs=1, init_process_group=False)[0]["probe"] is None


def test_fresh_ranks_when_asked():
    seen = run_function(_what_a_rank_sees, nprocs=2, init_process_group=False, env={"DSLAUNCH_TEST_FORK": "0"})
    assert not any(s["warm"] for s in seen) and all(s["own_group"] for s in seen)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_forked_rank_ends_as_a_fresh_one(tmp_path, fork):
    """Exit codes, a signal's negative code, atexit handlers and flushed output, both ways."""
    script = tmp_path / "ends.py"
    script.write_text("import atexit, os, signal, sys\n"
                      "atexit.register(lambda: print('atexit ran'))\n"
                      "print('buffered', end='')\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    os.kill(os.getpid(), signal.SIGTERM)\n"
                      "sys.exit(3)\n")
    runs = run_script([str(script)], nprocs=2, env={"DSLAUNCH_TEST_FORK": fork})
    assert runs[0].returncode == 3 and runs[0].stdout == "bufferedatexit ran\n", runs[0]
    assert runs[1].returncode == -15, runs[1]


def test_a_warm_start_that_fails_is_named_and_its_siblings_are_ready(tmp_path):
    """One start failing in a prepare() does not leave the others started beside it registered
    before their sockets are bound, nor itself registered at all."""
    import warm_ranks

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    good = dict(os.environ, RANK="0", HARNESS_PROBE_START="good")
    bad = dict(os.environ, RANK="0", PYTHONPATH=str(broken))
    with pytest.raises(RuntimeError, match="this torch is broken on purpose"):
        warm_ranks.prepare([good, bad])
    assert warm_ranks._key(bad) not in warm_ranks._warm
    assert os.path.exists(warm_ranks._warm[warm_ranks._key(good)].sock_path)


def test_results_come_back_in_rank_order():
    assert run_function(_rank_and_world, nprocs=2, init_process_group=False) == [(0, 2), (1, 2)]


@pytest.mark.timeout(30)
def test_failing_rank_stops_the_others_and_reports_its_error():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="boom on rank 1"):
        run_function(_rank1_fails, nprocs=2, init_process_group=False, timeout=60)
    assert time.monotonic() - start < 20


@pytest.mark.timeout(30)
def test_hang_fails_with_each_ranks_stack():
    with pytest.raises(DistHang) as info:
        run_function(_sleeps_forever_in_named_function, nprocs=2, init_process_group=False, timeout=5)
    text = str(info.value)
    assert "rank 0 stack" in text and "rank 1 stack" in text
    assert text.count("_sleeps_forever_in_named_function") >= 2


@pytest.mark.timeout(30)
def test_script_hang_reports_stack(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ndef wait_here():\n    time.sleep(600)\nwait_here()\n")
    with pytest.raises(DistHang, match="wait_here"):
        run_script([str(script)], nprocs=2, timeout=5)


def _world_size_through_gloo():
    import torch.distributed as dist

    return dist.get_world_size()


@pytest.mark.timeout(120)
def test_a_port_taken_before_rank_0_binds_it_is_replaced(monkeypatch):
    """The port the harness picked is taken by another program before rank 0's store binds it
    (EADDRINUSE): the ranks start again on a new port instead of failing the test."""
    import socket

    import dist_harness

    squatter = socket.socket()
    squatter.bind(("", 0))
    squatter.listen()
    picks = [squatter.getsockname()[1]]
    real = dist_harness.free_port
    monkeypatch.setattr(dist_harness, "free_port", lambda: picks.pop() if picks else real())
    try:
        assert dist_harness.run_function(_world_size_through_gloo, nprocs=2, timeout=100) == [2, 2]
    finally:
        squatter.close()
    assert picks == []  # the taken port was tried first
