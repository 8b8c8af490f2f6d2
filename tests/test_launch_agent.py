"""The node agent alone, over pipes (no SSH): it survives stray input, stops on EOF, and
kills its workers when the head falls silent for --heartbeat_timeout."""
import json
import subprocess
import sys
import time

import psutil
import pytest

from dslaunch.launcher.plan import WorkerPlan
from dslaunch.launcher.protocol import AgentRequest

AGENT = [sys.executable, "-u", "-m", "dslaunch.launcher.agent"]
SLEEPER = [sys.executable, "-u", "-c", "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)"]


def request(timeout=30.0, n=2):
    workers = tuple(WorkerPlan(r, r, tuple(SLEEPER), {"RANK": str(r)}) for r in range(n))
    return AgentRequest("h", workers, restart=0, kill_grace=2.0, heartbeat_s=0.2, heartbeat_timeout=timeout,
                        finished=False).to_line()


def start(first_line: bytes):
    agent = subprocess.Popen(AGENT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    agent.stdin.write(first_line)
    agent.stdin.flush()
    return agent


def events_until_pids(agent, n=2):
    pids, seen = [], []
    while len(pids) < n:
        raw = agent.stdout.readline()
        assert raw, agent.stderr.read().decode()
        ev = json.loads(raw)
        seen.append(ev)
        if ev["ev"] == "line" and ev["data"].startswith("pid "):
            pids.append(int(ev["data"].split()[1]))
    return pids


def done_event(agent):
    for raw in agent.stdout:
        ev = json.loads(raw)
        if ev["ev"] == "done":
            return ev
    raise AssertionError("no done event: " + agent.stderr.read().decode())


def gone(pids, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_stray_lines_do_not_stop_the_watch_and_eof_still_stops_the_workers():
    agent = start(request())
    try:
        pids = events_until_pids(agent)
        for junk in (b"[1, 2]\n", b"42\n", b"\"stop\"\n", b"not json\n", b"{\"cmd\": \"nonsense\"}\n"):
            agent.stdin.write(junk)
        agent.stdin.flush()
        time.sleep(0.5)
        assert not gone(pids, 0)  # still running: none of those lines is a stop
        agent.stdin.close()  # EOF: the head is gone
        done = done_event(agent)
        assert done["stopped_because"] == "the head's channel closed" and done["stop_signal"] == 15
        assert gone(pids, 5) and agent.wait(10) == 143
        assert b"not a JSON object" in agent.stderr.read()
    finally:
        agent.kill()


@pytest.mark.timeout(60)
def test_a_first_line_that_is_not_a_request_is_one_error_event():
    for first in (b"[1, 2]\n", b"{\"request\": 5}\n", b"{\"request\": {\"host\": \"h\"}}\n"):
        agent = start(first)
        out, _ = agent.communicate(timeout=30)
        ev = json.loads(out.splitlines()[0])
        assert agent.returncode == 2 and ev["ev"] == "error", out
        assert "not a JSON object" in ev["text"] or "not a request" in ev["text"] or "malformed" in ev["text"]


@pytest.mark.timeout(60)
def test_a_silent_head_is_lost_after_the_heartbeat_timeout():
    """The head never pings (a partition): the agent kills its workers within timeout + 5 s."""
    agent = start(request(timeout=2.0))
    try:
        pids = events_until_pids(agent)
        t0 = time.monotonic()
        done = done_event(agent)
        assert done["stopped_because"].startswith("lost the head: nothing from it for ")
        assert gone(pids, 5) and time.monotonic() - t0 < 2.0 + 5
    finally:
        agent.kill()
