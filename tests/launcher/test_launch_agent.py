"""The node agent alone, over pipes (no SSH): it survives stray input, stops on EOF, and
kills its workers when the head falls silent for --heartbeat_timeout. Under pdsh: it reads
only a request file that no other user could have written, and runs nothing until the head
has proved it knows the file's token."""
import json
import os
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


# -- pdsh: the request file and the token handshake -------------------------------------------
OTHER_UID = 65534  # "nobody": a user other than the one running the tests


def _marker_request(marker, port=1, token="0" * 32):
    """A pdsh request whose only worker creates `marker`: whether anything ran is visible."""
    argv = (sys.executable, "-c", f"open({str(marker)!r}, 'w').close()")
    req = AgentRequest("h", (WorkerPlan(0, 0, argv, {"RANK": "0"}),), restart=0, kill_grace=2.0, heartbeat_s=0.2,
                       heartbeat_timeout=30.0, finished=False)
    return json.dumps({"request": req.to_dict(), "control": {"port": port, "token": token}}).encode()


def _private_request(folder, body, name="request.json"):
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, body)
    os.close(fd)
    return path


def _run_agent(path, env=None, timeout=30):
    proc = subprocess.run([*AGENT, "--request_file", str(path)], capture_output=True, timeout=timeout,
                          env={**os.environ, "SSH_CONNECTION": "127.0.0.1 40000 127.0.0.1 22", **(env or {})})
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    return proc.returncode, events


@pytest.mark.parametrize("how", ["folder_link", "folder_of_another_user", "folder_0755", "file_of_another_user",
                                 "file_0644", "file_link", "file_hard_link"])
@pytest.mark.timeout(60)
def test_the_agent_refuses_a_request_file_another_user_could_have_written(tmp_path, how):
    if "another_user" in how and os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")
    from dslaunch.launcher.protocol import control_proof

    token = "7" * 32
    # a live head that answers the handshake: what stops the worker is the file check alone
    head = _FakeHead(lambda h: {"proof": control_proof(token, "head", h["nonce"])})
    marker = tmp_path / "ran"
    real = tmp_path / "real"
    path = _private_request(real, _marker_request(marker, head.port, token))
    if how == "folder_link":  # `.dslaunch -> a folder of ours`: the link itself could be anyone's
        (tmp_path / ".dslaunch").symlink_to(real)
        path = tmp_path / ".dslaunch" / path.name
    elif how == "folder_of_another_user":
        os.chown(real, OTHER_UID, OTHER_UID)
    elif how == "folder_0755":
        os.chmod(real, 0o755)
    elif how == "file_of_another_user":
        os.chown(path, OTHER_UID, OTHER_UID)
    elif how == "file_0644":
        os.chmod(path, 0o644)
    elif how == "file_link":
        (real / "link.json").symlink_to(path)
        path = real / "link.json"
    elif how == "file_hard_link":
        os.link(path, tmp_path / "elsewhere.json")
    try:
        code, events = _run_agent(path)
    finally:
        head.close()
    assert code == 2 and len(events) == 1 and events[0]["ev"] == "error", events
    assert str(path) in events[0]["text"] and "\n" not in events[0]["text"], events
    assert not marker.exists()


class _FakeHead:
    """The head's end of pdsh's control socket, answering the handshake with `answer(hello)`."""

    def __init__(self, answer):
        import socket
        import threading

        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.hello = None
        self.answer = answer
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        try:
            conn, _ = self.server.accept()
        except OSError:
            return
        self.conns.append(conn)
        self.hello = json.loads(conn.makefile("rb").readline())
        reply = self.answer(self.hello)
        if reply is not None:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        else:
            conn.close()

    def close(self):
        self.server.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("answer", ["right", "wrong", "echo", "silent"])
@pytest.mark.timeout(60)
def test_the_agent_runs_nothing_until_the_head_proves_the_token(tmp_path, answer):
    from dslaunch.launcher.protocol import control_proof

    token = "5" * 32
    replies = {"right": lambda h: {"proof": control_proof(token, "head", h["nonce"])},
               "wrong": lambda h: {"proof": control_proof("6" * 32, "head", h["nonce"])},
               "echo": lambda h: {"proof": h["proof"]},  # a relay that knows no token replays the agent's
               "silent": lambda h: None}
    head = _FakeHead(replies[answer])
    marker = tmp_path / "ran"
    try:
        path = _private_request(tmp_path / ".dslaunch", _marker_request(marker, head.port, token))
        code, events = _run_agent(path)
    finally:
        head.close()
    # the token itself never crossed the wire, only a proof bound to the agent's nonce
    assert token not in json.dumps(head.hello) and head.hello["proof"] == control_proof(token, "agent",
                                                                                          head.hello["nonce"])
    assert not path.exists()  # read once, then removed
    if answer == "right":
        assert code == 0 and events[-1]["ev"] == "done" and marker.exists(), events
    else:
        assert code == 2 and [e["ev"] for e in events] == ["error"], events
        assert "did not prove it knows this request's token; running nothing" in events[0]["text"]
        assert not marker.exists()
