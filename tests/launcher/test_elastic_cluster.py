"""Elastic jobs on the namespace SSH cluster (tests/testbed.py): 3 hosts x 2 slots.

Each test runs tests/workers/elastic_job.py, a plain DeepSpeed-style script, under
`dslaunch --min_nodes ... --checkpoint_dir ... --checkpoint_every 4`, changes the cluster
while it runs, and compares every step's loss with the same script in one process (the
same global batch, so the same samples per step: equal up to the order of the sums).

The job is paced by a file (PACE): rank 0 starts step N only once PACE holds N or more, so
each event lands at a known step whatever the machine's load, and nothing is timed.
"""
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import testbed
import repo_paths
from dist_harness import DSLAUNCH

WORKER = str(repo_paths.WORKERS / "elastic_job.py")
STEP = re.compile(r"^\[(\S+):(\d+)\] step (\d+) loss (\S+) world (\d+)$")
pytestmark = [pytest.mark.testbed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Its own 3-host cluster (subnets 10.213.140-159), beside the session's 2-host one."""
    try:
        tb = testbed.build_free("de", 140, 20, 3, tmp_path_factory.mktemp("testbed3"))
    except testbed.TestbedUnavailable as exc:
        pytest.skip(f"cannot build the SSH test cluster: {exc}")
    try:
        yield tb
    finally:
        tb.teardown()


def reference(case, steps, tmp_path):
    """Every step's loss from one process (the same global batch)."""
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {**{k: v for k, v in os.environ.items() if k not in rendezvous}, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, WORKER, case, str(steps)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    out = {}
    for line in res.stdout.splitlines():
        m = re.match(r"^step (\d+) loss (\S+) world 1$", line)
        if m:
            out[int(m.group(1))] = float(m.group(2))
    assert sorted(out) == list(range(1, steps + 1)), res.stdout
    return out


class Job:
    """A running dslaunch whose stdout/stderr lines the test waits on."""

    def __init__(self, args, env, cwd, pace):
        self.pace = pace
        self.set_pace(0)
        self.proc = subprocess.Popen(DSLAUNCH + args, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines = queue.Queue()
        self.out, self.err = [], []
        for stream, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()
        self.steps = []  # (step, loss, world) in the order printed

    def _read(self, stream, into):
        for line in stream:
            into.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def set_pace(self, n):
        tmp = Path(f"{self.pace}.tmp")
        tmp.write_text(str(n))
        tmp.replace(self.pace)

    def wait_for(self, pattern, timeout=300):
        """The first line from now on that matches; step lines are recorded on the way."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no line matching {pattern!r}; stderr:\n" + "\n".join(self.err[-40:])
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, f"dslaunch ended before {pattern!r}; stderr:\n" + "\n".join(self.err[-40:])
            m = STEP.match(line)
            if m:
                self.steps.append((int(m.group(3)), float(m.group(4)), int(m.group(5))))
            if re.search(pattern, line):
                return line

    def next_step_says(self, pattern):
        """Allow one more step and wait for the line it brings: a request every host's workers
        already have (the head said so) is acted on at that step. (Not the step's own loss line:
        rank 0's stderr reaches the console a moment after its stdout.)"""
        self.set_pace(self.steps[-1][0] + 1)
        return self.wait_for(pattern)

    def finish(self, timeout=600):
        code = self.proc.wait(timeout=timeout)
        while True:
            try:
                line = self.lines.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                continue
            m = STEP.match(line)
            if m:
                self.steps.append((int(m.group(3)), float(m.group(4)), int(m.group(5))))
        return code

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _hostfile(tmp_path, hosts):
    p = tmp_path / "hosts"
    p.write_text("".join(f"{h.name} slots=2\n" for h in hosts))
    return str(p)


def _start(cluster, tmp_path, hosts, case, steps, extra=()):
    home = tmp_path / "home"
    env = cluster.ssh_env(home)
    env["GLOO_SOCKET_IFNAME"] = "eth0"
    env["OMP_NUM_THREADS"] = "1"
    args = ["-H", _hostfile(tmp_path, hosts), "--master_port", "0", "--heartbeat_timeout", "5", "--kill_grace", "3",
            "--checkpoint_dir", str(tmp_path / "ck"), "--checkpoint_every", "4", *extra,
            WORKER, case, str(steps), str(tmp_path / "pace")]
    return Job(args, env, tmp_path, tmp_path / "pace"), env


def _losses_match(job, ref):
    for step, loss, world in job.steps:
        assert abs(loss - ref[step]) < 1e-5, (step, loss, ref[step], world)


def _no_job_processes_left(cluster, timeout=20):
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in cluster.host_pids():
            if pid in cluster.sshd_pids():
                continue
            try:
                cmd = psutil.Process(pid).cmdline()
            except psutil.Error:
                continue
            if cmd and not cmd[0].startswith(("sshd", "/usr/sbin/sshd")):
                left.append(" ".join(cmd))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_lost_host_shrinks_then_grows_back_with_the_same_losses(cluster, tmp_path):
    """ZeRO-2 on 3 hosts: host 3 dies (processes and sshd) at step 6; the job goes on on 2
    hosts from the checkpoint of step 4 with accumulation 3 instead of 2; host 3's sshd comes
    back, the job grows to 3 hosts at its next checkpoint; every loss is the one-process run's."""
    steps = 16
    ref = reference("zero2", steps, tmp_path)
    h = cluster.hosts
    job, _ = _start(cluster, tmp_path, h, "zero2", steps, ["--min_nodes", "2"])
    try:
        job.set_pace(6)
        job.wait_for(r"\] step 6 loss .* world 6$")
        cluster.crash_host(2)
        lost = job.wait_for(rf"host {h[2].name} lost at step")
        assert re.search(rf"dslaunch: host {h[2].name} lost at step 6 \(its agent's connection dropped\); "
                         r"resuming on 2 of 3 hosts from step 4, accumulation 2 -> 3$", lost), lost
        job.set_pace(8)
        job.wait_for(r"\] step 8 loss .* world 4$")
        cluster.restart_host(2)
        job.wait_for(rf"{h[2].name} answers again: it joins at the next checkpoint")
        job.next_step_says(r"a host joins: stopping after the checkpoint at step 12")
        job.set_pace(steps)
        grow = job.wait_for(rf"{h[2].name} is back; growing to 3 hosts")
        assert grow.endswith("growing to 3 hosts at step 12; resuming on 3 of 3 hosts from step 12, "
                             "accumulation 3 -> 2"), grow
        assert job.finish() == 0, "\n".join(job.err[-30:])
    finally:
        job.kill()
    worlds = {}
    for step, _, world in job.steps:
        worlds.setdefault(world, set()).add(step)
    assert {5, 6} <= worlds[6] & worlds[4]  # redone after the loss: lost steps since the checkpoint
    assert worlds[6] >= {1, 2, 3, 4, steps} and max(s for s, _, _ in job.steps) == steps
    _losses_match(job, ref)
    assert "Traceback" not in "\n".join(job.err)
    assert not _no_job_processes_left(cluster)


def test_drain_loses_no_step_and_undrain_grows_back(cluster, tmp_path):
    """ZeRO-3 on 3 hosts: `dslaunch drain HOST` saves at the next step boundary, the job goes
    on on 2 hosts without redoing a step; bad drains are refused in one line; `dslaunch
    undrain HOST` lets it join again at the next checkpoint; losses as one process's."""
    steps = 14
    ref = reference("zero3", steps, tmp_path)
    h = cluster.hosts
    job, env = _start(cluster, tmp_path, h, "zero3", steps, ["--min_nodes", "2"])

    def ctl(*args):
        return subprocess.run(DSLAUNCH + list(args), env=env, capture_output=True, text=True, timeout=60)

    try:
        run_id = job.wait_for(r"dslaunch: elastic job \S+:").split("elastic job ")[1].split(":")[0]
        job.set_pace(5)
        job.wait_for(r"\] step 5 loss .* world 6$")
        bad = ctl("drain", "nosuchhost", "--job", run_id)
        assert bad.returncode == 2 and bad.stderr.startswith("dslaunch drain: error: nosuchhost: not a host of job")
        ok = ctl("drain", h[1].name, "--job", run_id)
        assert ok.returncode == 0 and f"draining {h[1].name}: the job saves at the next step boundary" in ok.stdout
        # said once every host's workers have the request: they act on it at their next step
        job.wait_for(rf"dslaunch: draining {h[1].name} \(dslaunch drain\): the job saves at the next step boundary")
        job.next_step_says(r"drain requested: saving at step 6 ")
        at = 6
        drained = job.wait_for(rf"host {h[1].name} drained at step")
        assert drained.endswith(f"host {h[1].name} drained at step {at}; resuming on 2 of 3 hosts from step {at}, "
                                "accumulation 2 -> 3"), drained
        job.set_pace(at + 2)
        job.wait_for(rf"\] step {at + 2} loss .* world 4$")
        below = ctl("drain", h[0].name, "--job", run_id)
        assert below.returncode == 2 and "below --min_nodes 2" in below.stderr, below.stderr
        assert ctl("undrain", h[1].name, "--job", run_id).returncode == 0
        job.wait_for(rf"{h[1].name} answers again")
        job.next_step_says(r"a host joins: stopping after the checkpoint at step 12")
        job.set_pace(steps)
        job.wait_for(rf"{h[1].name} is back; growing to 3 hosts")
        assert job.finish() == 0, "\n".join(job.err[-30:])
    finally:
        job.kill()
    printed = [s for s, _, _ in job.steps]
    assert printed == list(range(1, steps + 1)), printed  # no step lost, none redone
    assert {w for s, _, w in job.steps if s <= at} == {6} and {w for s, _, w in job.steps if s > at} >= {4, 6}
    _losses_match(job, ref)
    assert not _no_job_processes_left(cluster)


def test_pipeline_shrinks_from_two_replicas_to_one(cluster, tmp_path):
    """A 2-stage pipeline on 2 hosts (2 data-parallel replicas) loses host 2 at step 6 and goes
    on as one replica on host 1 with twice the micro batches; losses as one process's."""
    steps = 10
    ref = reference("pipe1", steps, tmp_path)
    h = cluster.hosts[:2]
    job, _ = _start(cluster, tmp_path, h, "pipe", steps, ["--nnodes", "1:2"])
    try:
        job.set_pace(6)
        job.wait_for(r"\] step 6 loss .* world 4$")
        cluster.crash_host(1)
        lost = job.wait_for(rf"host {h[1].name} lost at step")
        assert lost.endswith("resuming on 1 of 2 hosts from step 4, accumulation 4 -> 8"), lost
        job.set_pace(steps)
        assert job.finish() == 0, "\n".join(job.err[-30:])
    finally:
        job.kill()
        cluster.restart_host(1)
    assert [s for s, _, w in job.steps if w == 2] == list(range(5, steps + 1))
    _losses_match(job, ref)
    assert not _no_job_processes_left(cluster)
