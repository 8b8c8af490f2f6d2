"""The launcher at a thousand nodes, by simulation: the real head drives N real node agents.

    python scripts/bench_scale.py --nodes 16 64 256 1024 --json scripts/bench_scale.json \
        --plot docs/images/bench_scale.png

What is real: the plan (build_plan on a generated N-host hostfile), the Head and its
heartbeat/failure logic, the agent (`dslaunch.launcher.agent.main`, its Supervisor, its
watchdog process) and each node's worker (`/bin/sh -c 'echo up; exec sleep ...'`). What is
simulated: only the transport. A SimLink is the head's AgentLink over one Unix socketpair
per node, standing in for the SSH channel (the agent sees the request and pings on
stdin and writes its events to stdout, exactly as under ssh).

Why agents are forked from a zygote: on a 2-core machine 1024 agents started as
`python -m dslaunch.launcher.agent` would cost ~1024 interpreter start-ups and imports
(tens of CPU seconds) before any launcher code runs, which measures Python, not the
launcher. So the harness forks, before it starts any thread, one zygote process that has
imported the agent's modules; for each node the head hands the zygote its end of the
socketpair (SCM_RIGHTS) and the zygote forks a child that puts the socket on fds 0 and
1 and calls the agent's main(). Each agent is still a process of its own (its own
subreaper, signal handlers, watchdog), so killing or freezing one is one node lost.

Measured per N: seconds until every worker has printed `up` on the head's console,
head CPU seconds per second and heartbeat bytes per second (both directions, all links)
over a steady window, head RSS, threads and open fds, seconds to detect one lost node
(one agent frozen with SIGSTOP: a silent host, as a partition or a dead machine looks,
so only the heartbeat can find it), and teardown: from that detection until the head has
returned and every other agent process has exited. Beside the wall seconds, which the load of
other jobs on the machine stretches, CPU seconds: the head's during the start and the teardown,
and the agents' (each agent's process tree) by the time every worker was up.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import select
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dslaunch.launcher import agent as agent_module
# what agent.run imports when a request arrives: loaded once in the zygote, not in each agent
from dslaunch.launcher import local, machine, plan, reaper, supervisor  # noqa: F401
from dslaunch.launcher.head import AgentLink, Head
from dslaunch.launcher.machine import MachineFacts
from dslaunch.launcher.options import LaunchOptions
from dslaunch.launcher.output import JobOutput
from dslaunch.launcher.plan import build_plan
from dslaunch.launcher.line_reader import shared_reader
from dslaunch.launcher.protocol import AgentRequest, decode

WORKER_SLEEP_S = 600  # a worker outlives any run; the head's stop is what ends it


# --------------------------------------------------------------------------- the zygote
class Zygote:
    """A forked process holding the agent's imported modules; forks one agent per request."""

    def __init__(self, log_dir: str):
        """Each agent's stderr goes to log_dir/agent-PID.err."""
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the zygote
            self._sock.close()
            try:
                _zygote_loop(child, log_dir)
            finally:
                os._exit(0)
        child.close()
        self.pid = pid
        self._lock = threading.Lock()

    def spawn(self, fd: int) -> int:
        """Start an agent on `fd` (its stdin and stdout); returns the agent's pid."""
        with self._lock:
            socket.send_fds(self._sock, [b"s"], [fd])
            data = b""
            while len(data) < 4:
                more = self._sock.recv(4 - len(data))
                if not more:
                    raise RuntimeError("the agent zygote died")
                data += more
            return int.from_bytes(data, "little")

    def close(self) -> None:
        self._sock.close()
        os.waitpid(self.pid, 0)


def _zygote_loop(ctl: socket.socket, log_dir: str) -> None:
    # every object the zygote holds is the agents' shared, copy-on-write memory: moved out of
    # the collector's reach, an agent's garbage collections no longer write to (and so copy)
    # each page of it; a real agent has its own memory, so this only keeps the simulation honest
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    while True:
        ready, _, _ = select.select([ctl], [], [], 0.2)
        while True:  # reap finished agents
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(ctl, 1, 1)
        if not msg:
            return
        pid = os.fork()
        if pid == 0:  # one node agent
            code = 1
            try:
                ctl.close()
                os.setsid()  # its own session, as under sshd
                os.dup2(fds[0], 0)
                os.dup2(fds[0], 1)
                err = os.open(os.path.join(log_dir, f"agent-{os.getpid()}.err"), os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(err, 2)
                os.close(err)
                os.close(fds[0])
                code = 0
                agent_module.main([])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            finally:
                os._exit(code)
        os.close(fds[0])
        ctl.sendall(pid.to_bytes(4, "little"))


# --------------------------------------------------------------------------- the fake transport
class SimLink(AgentLink):
    """The head's link to one simulated host: a socketpair to an agent the zygote forks."""

    def __init__(self, host: str, zygote: Zygote, traffic: "Traffic"):
        super().__init__(host)
        self._zygote = zygote
        self._traffic = traffic
        self._sock, self._far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid: Optional[int] = None

    def start(self, post, request: AgentRequest) -> None:
        self.pid = self._zygote.spawn(self._far.fileno())
        self._far.close()
        def line(raw: bytes) -> None:
            self._traffic.add_rx(len(raw))
            post(decode(raw) or {"ev": "agent_err", "text": raw.decode("utf-8", "replace")})

        # the head's one reader thread for every link, as LocalLink's pipes use it
        shared_reader().add(self._sock.fileno(), line, lambda: post({"ev": "eof"}))
        self.send(request.to_line())

    def write_nowait(self, data: bytes) -> int:
        try:
            n = self._sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        self._traffic.add_tx(n)
        return n

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)
        self._traffic.add_tx(len(data))

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)  # the agent reads EOF, as when ssh closes stdin
        except OSError:
            pass


class Traffic:
    def __init__(self):
        self._lock = threading.Lock()
        self.rx = self.tx = 0

    def add_rx(self, n: int) -> None:
        with self._lock:
            self.rx += n

    def add_tx(self, n: int) -> None:
        with self._lock:
            self.tx += n


class TimedOutput(JobOutput):
    """The head's JobOutput, noting when the head declared the failure (the console prints it later)."""

    failed_at: Optional[float] = None
    failed_cpu: Optional[float] = None
    failure_text = ""

    def failed(self, failure) -> None:
        if self.failed_at is None:
            self.failed_at, self.failed_cpu = time.monotonic(), _cpu()
            self.failure_text = failure.reason
        super().failed(failure)


class Console:
    """The head's console: counts workers' `up` lines."""

    def __init__(self, workers: int):
        self.workers = workers
        self.up = 0
        self.all_up = threading.Event()
        self.text: List[bytes] = []

    def write(self, data: bytes) -> int:
        self.text.append(data)
        self.up += data.count(b"up\n")
        if self.up >= self.workers:
            self.all_up.set()
        return len(data)

    def flush(self) -> None:
        pass


# --------------------------------------------------------------------------- one run
@dataclass
class Figures:
    nodes: int
    heartbeat_timeout_s: float
    heartbeat_interval_s: float
    start_s: float  # Head started -> every worker's `up` on the console
    head_cpu_per_s: float  # head CPU seconds per wall second, steady state
    heartbeat_bytes_per_s: float  # both directions, all links, steady state
    head_rss_mb: float
    head_threads: int
    head_fds: int
    detect_s: float  # one agent frozen -> the head names its host lost
    teardown_s: float  # that detection -> the head returned and every other agent exited
    head_return_s: float  # that detection -> the head returned (its part of the teardown)
    start_cpu_s: float  # head CPU seconds spent during start_s
    agents_start_cpu_s: float  # CPU seconds of every agent process and its children (watchdog, worker) when all were up
    teardown_cpu_s: float  # head CPU seconds from the detection until the head returned
    exit_code: int


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def run_once(n: int, zygote: Zygote, *, heartbeat_timeout: float, window_s: float, workdir: str,
             timeout_s: float = 300.0) -> Figures:
    hostfile = Path(workdir, f"hosts{n}")
    hostfile.write_text("".join(f"sim{i:05d} slots=1\n" for i in range(n)))
    opts = LaunchOptions("/bin/sh", ("-c", f"echo up; exec sleep {WORKER_SLEEP_S}"), hostfile=str(hostfile),
                         no_python=True, no_local_rank=True, master_port=29500, kill_grace=2.0,
                         heartbeat_timeout=heartbeat_timeout, workdir=workdir)
    facts = MachineFacts(0, None, os.cpu_count() or 1, ("head-of-sim",), cwd=workdir, home=workdir)
    plan = build_plan(opts, facts, {}, run_id="scale-sim", master_addr_of=lambda target: target)
    traffic = Traffic()
    console = Console(plan.world.world_size)
    output = TimedOutput(console, console, run_id=plan.run_id)
    links: List[SimLink] = []

    def open_links(nodes: Sequence) -> List[AgentLink]:
        links.extend(SimLink(node.target, zygote, traffic) for node in nodes)
        return list(links)

    head = Head(plan, open_links, output, None)
    marks: Dict[str, float] = {}
    victim: Dict[str, int] = {}

    def drive() -> None:
        if not console.all_up.wait(timeout_s):
            marks["gave_up"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)  # the head's own stop path
            return
        marks["up"], marks["up_cpu"] = time.monotonic(), _cpu()
        marks["agents_cpu"] = sum(_tree_cpu(link.pid) for link in links)
        time.sleep(max(1.0, head.interval * 2))  # let start-up traffic drain
        cpu0, rx0, tx0, w0 = _cpu(), traffic.rx, traffic.tx, time.monotonic()
        time.sleep(window_s)
        cpu1, rx1, tx1, w1 = _cpu(), traffic.rx, traffic.tx, time.monotonic()
        marks["cpu"] = (cpu1 - cpu0) / (w1 - w0)
        marks["bytes"] = (rx1 + tx1 - rx0 - tx0) / (w1 - w0)
        marks["rss"] = _rss_mb()
        marks["threads"] = threading.active_count()
        marks["fds"] = len(os.listdir("/proc/self/fd"))
        lost = links[len(links) // 2]
        try:
            os.kill(lost.pid, signal.SIGSTOP)
        except ProcessLookupError:  # the job already ended (run_once says why)
            return
        victim["pid"] = lost.pid
        marks["frozen"] = time.monotonic()

    marks["start"], marks["start_cpu"] = time.monotonic(), _cpu()
    driver = threading.Thread(target=drive, daemon=True, name="bench-driver")
    driver.start()
    code = head.run()
    returned, returned_cpu = time.monotonic(), _cpu()
    output.close(timeout=10)
    driver.join(timeout=5)
    others = [link.pid for link in links if link.pid is not None and link.pid != victim.get("pid")]
    while others and time.monotonic() - returned < 30:  # each pid is looked at until it is gone, not each poll
        others = [p for p in others if _alive(p)]
        if others:
            time.sleep(0.01)
    gone = time.monotonic()
    if "pid" in victim:
        os.kill(victim["pid"], signal.SIGKILL)
    for link in links:
        link._sock.close()
    lost = output.failed_at is not None and "nothing from its agent" in output.failure_text
    if "gave_up" in marks or not lost or "frozen" not in marks:
        sys.stderr.write(b"".join(console.text[-20:]).decode("utf-8", "replace"))
        for log in sorted(Path(workdir).glob("agent-*.err"))[:3]:
            sys.stderr.write(f"{log.name}: {log.read_text()[-2000:]}\n")
        raise RuntimeError(f"{output.failure_text!r}: "f"{n} nodes: {'not every worker started' if 'gave_up' in marks else 'no host was lost'}"
                           f" (exit {code}, {console.up}/{console.workers} up)")
    return Figures(n, heartbeat_timeout, head.interval, marks["up"] - marks["start"], marks["cpu"], marks["bytes"],
                   marks["rss"], marks["threads"], marks["fds"], output.failed_at - marks["frozen"],
                   gone - output.failed_at, returned - output.failed_at, marks["up_cpu"] - marks["start_cpu"],
                   marks["agents_cpu"],
                   returned_cpu - output.failed_cpu, code)


def _tree_cpu(pid: int) -> float:
    """CPU seconds of pid and every process below it (those reaped count through cutime/cstime)."""
    total = 0
    for p in [pid] + reaper.descendants(pid):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                total += sum(int(v) for v in f.read().rsplit(b")", 1)[1].split()[11:15])
        except (OSError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plot(rows: List[Figures], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r.nodes for r in rows]
    # (title, [(label, values)]): wall seconds beside the CPU seconds that load distorts less
    panels = [("start-up (s)", [("wall", [r.start_s for r in rows]), ("head CPU", [r.start_cpu_s for r in rows]),
                                ("agents' CPU", [r.agents_start_cpu_s for r in rows])]),
              ("teardown (s)", [("wall", [r.teardown_s for r in rows]), ("head CPU", [r.teardown_cpu_s for r in rows])]),
              ("lost node detected (s)", [("", [r.detect_s for r in rows])]),
              ("head CPU (s per s)", [("", [r.head_cpu_per_s for r in rows])]),
              ("heartbeat traffic (kB/s)", [("", [r.heartbeat_bytes_per_s / 1e3 for r in rows])]),
              ("head RSS (MB)", [("", [r.head_rss_mb for r in rows])])]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (title, series) in zip(axes.flat, panels):
        for label, ys in series:
            ax.plot(ns, ys, "o-", label=label or None)
        ax.set_xscale("log", base=2)
        if not title.startswith("lost"):  # log-log: a straight line of slope 1 is O(N)
            ax.set_yscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_title(title)
        ax.set_xlabel("simulated nodes")
        ax.grid(alpha=0.3)
        if title.startswith("lost"):
            ax.axhline(rows[0].heartbeat_timeout_s, color="r", ls="--", label="--heartbeat_timeout")
        if len(series) > 1 or title.startswith("lost"):
            ax.legend()
    fig.suptitle("dslaunch head driving N real node agents (simulated transport, 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--heartbeat_timeout", type=float, default=10.0)
    ap.add_argument("--window", type=float, default=5.0, help="seconds of steady state measured")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--plot", help="write a PNG of the figures here (needs matplotlib)")
    args = ap.parse_args(argv)
    if any(n < 2 for n in args.nodes):
        ap.error("--nodes: every count must be at least 2 (one node is frozen, the others stop)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="dslaunch-scale-") as workdir:
        zygote = Zygote(workdir)  # before any thread exists: the zygote forks agents from a one-thread process
        try:
            for n in args.nodes:
                row = run_once(n, zygote, heartbeat_timeout=args.heartbeat_timeout, window_s=args.window,
                               workdir=workdir)
                rows.append(row)
                print(json.dumps(asdict(row)), flush=True)
        finally:
            zygote.close()
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
