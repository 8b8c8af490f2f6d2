"""The head of a multi-node job: one node agent per host, one job made of them.

    head ──ssh──> agent (host A) ──> workers rank 0..k
         ──ssh──> agent (host B) ──> workers rank k+1..

The head resolves the world (world.py), builds every worker's argv and environment
(the single-node contract plus the forwarded variables), connects to all hosts at once,
and starts `python -m dslaunch.launcher.agent` on each, handing it its node's plan as one
JSON line on stdin. Nothing reaches a remote shell but the interpreter path and working
directory, both quoted: arguments and values travel as JSON and arrive byte-for-byte.

Keeping the job whole:
- an agent reports its node's first failure in its `done` event; the head then tells every
  other agent to stop (they SIGTERM their workers at once, SIGKILL after --kill_grace) and
  exits with the first failure's code, naming host and rank and the tail of its stderr;
- SIGINT/SIGTERM to the head: the same stop everywhere, exit 128+N;
- the head dies (SIGKILL) or a connection drops: the agent sees EOF on stdin (sshd
  closes the session) and tears its workers down. Signal requests over SSH are not used
  because OpenSSH refuses them for root sessions.
- --max_restarts restarts the whole job on every node, with a new restart count.

Hosts that are this machine get their agent as a local subprocess speaking the same
protocol, so a hostfile that mixes localhost and remote hosts works.
"""
from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from dslaunch.launcher.ssh import connect_all
from dslaunch.launcher.ssh_options import MultiNodeOptions, SshOptions

STOP = json.dumps({"cmd": "stop"}) + "\n"


@dataclass(frozen=True)
class WorkerPlan:
    rank: int
    local_rank: int
    argv: Tuple[str, ...]
    env: Dict[str, str]


@dataclass(frozen=True)
class NodePlan:
    """Everything one agent needs; serialised as the JSON line on the agent's stdin."""
    node_rank: int
    host: str          # ssh target (user@host or host), also the output prefix
    workers: Tuple[WorkerPlan, ...]
    kill_grace: float
    log_dir: Optional[str] = None

    def to_json(self) -> str:
        d = asdict(self)
        d["workers"] = [dict(w, argv=list(w["argv"])) for w in d["workers"]]
        return json.dumps(d) + "\n"


@dataclass(frozen=True)
class Failure:
    host: str
    rank: Optional[int]
    code: int
    how: str
    tail: Tuple[str, ...] = ()


@dataclass
class Attempt:
    """One run of the whole job across all nodes."""
    code: int = 0
    first_failure: Optional[Failure] = None
    interrupted_by: Optional[int] = None


def agent_command(python: str, workdir: str) -> str:
    """The only shell line that reaches a remote host: both words quoted."""
    return f"cd {shlex.quote(workdir)} && exec {shlex.quote(python)} -u -m dslaunch.launcher.agent"


class _Link:
    """One agent's control channel: stdin for the plan and stop, stdout for events."""

    def __init__(self, host: str):
        self.host = host
        self.lock = threading.Lock()

    def send(self, text: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def safe_send(self, text: str) -> None:
        with self.lock:
            try:
                self.send(text)
            except Exception:
                pass  # a dead link ends in an eof event from its reader


class _SshLink(_Link):
    def __init__(self, host: str, client, python: str, workdir: str):
        super().__init__(host)
        self.client = client
        self.chan = client.get_transport().open_session()
        self.chan.exec_command(agent_command(python, workdir))
        self.out = self.chan.makefile("rb")
        self.err = self.chan.makefile_stderr("rb")

    def send(self, text: str) -> None:
        self.chan.sendall(text.encode())

    def close(self) -> None:
        try:
            self.chan.close()
        except Exception:
            pass


class _LocalLink(_Link):
    def __init__(self, host: str, python: str, workdir: str):
        super().__init__(host)
        self.proc = subprocess.Popen(
            [python, "-u", "-m", "dslaunch.launcher.agent"], cwd=workdir,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.out, self.err = self.proc.stdout, self.proc.stderr

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


Sink = Callable[[str, str], None]  # (stream "out"/"err", full line without newline)


def default_sink(stream: str, line: str) -> None:
    f = sys.stdout if stream == "out" else sys.stderr
    f.write(line + "\n")
    f.flush()


@dataclass
class MultiNodeRunner:
    plans_for: Callable[[int], List[NodePlan]]   # restart count -> plans
    ssh: SshOptions
    python: str
    workdir: str
    local_hosts: Sequence[str] = ()
    max_restarts: int = 0
    sink: Sink = default_sink
    tail_lines: int = 10
    connections: Optional[object] = None  # ssh.ConnectResult opened by the caller (preflight), reused
    line_log: Optional[Callable[[int, str, str], None]] = None  # (rank, stream, text): --log_dir
    _events: "queue.Queue" = field(default_factory=queue.Queue)

    # ------------------------------------------------------------------ public
    def run(self) -> int:
        hosts = [p.host for p in self.plans_for(0)]
        remote = [h for h in hosts if h not in self.local_hosts]
        conns = self.connections if self.connections is not None else self._connect(remote)
        if conns.errors:
            conns.close()
            for host in remote:
                if host in conns.errors:
                    self.sink("err", f"dslaunch: {conns.errors[host]}")
            return 255
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in old:
            signal.signal(s, lambda signum, frame: self._events.put((None, {"ev": "signal", "sig": signum})))
        try:
            restart = 0
            while True:
                attempt = self._attempt(self.plans_for(restart), conns.clients)
                if attempt.code == 0 or attempt.interrupted_by or restart >= self.max_restarts:
                    break
                restart += 1
                self.sink("err", f"dslaunch: restarting the whole job on every node ({restart}/{self.max_restarts})")
            return attempt.code
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            conns.close()

    # ------------------------------------------------------------------ one attempt
    def _attempt(self, plans: List[NodePlan], clients) -> Attempt:
        result = Attempt()
        links: List[_Link] = []
        # a fresh queue per attempt: the previous attempt's readers may still post their eofs
        self._events = queue.Queue()
        try:
            self._open_links(plans, clients, links)
        except Exception as exc:  # opening a session failed: stop what started, report the host
            host = plans[min(len(links), len(plans) - 1)].host
            self.sink("err", f"dslaunch: {host}: cannot start the node agent: {exc}")
            for link in links:
                link.safe_send(STOP)
            result.code = 255
            self._drain(links, set(range(len(links))), deadline=time.monotonic() + 10)
            return result

        pending = set(range(len(links)))
        stop_deadline: Optional[float] = None
        grace = max((p.kill_grace for p in plans), default=5.0)
        while pending:
            timeout = None if stop_deadline is None else max(0.0, stop_deadline - time.monotonic())
            try:
                idx, ev = self._events.get(timeout=timeout if timeout is not None else 0.5)
            except queue.Empty:
                if stop_deadline is not None and time.monotonic() >= stop_deadline:
                    # agents that did not finish in time lose their channel: EOF makes them kill
                    for i in pending:
                        links[i].close()
                    break
                continue
            kind = ev.get("ev")
            if kind == "signal":
                if result.interrupted_by is None:
                    result.interrupted_by = ev["sig"]
                    result.code = 128 + ev["sig"]
                    self.sink("err", f"dslaunch: got signal {ev['sig']}; stopping workers on every node")
                    for i in pending:
                        links[i].safe_send(STOP)
                    stop_deadline = time.monotonic() + grace + 5
                continue
            host = links[idx].host
            if kind == "line":
                self.sink(ev["stream"], f"[{host}:{ev['rank']}] {ev['text']}")
                if self.line_log is not None:
                    self.line_log(ev["rank"], ev["stream"], ev["text"])
            elif kind == "agent_err":
                self.sink("err", f"[{host} agent] {ev['text']}")
            elif kind in ("failed", "done", "eof"):
                if idx not in pending:
                    continue
                if kind != "failed":
                    pending.discard(idx)
                if kind == "eof":
                    fail = Failure(host, None, 255, "lost its node agent (connection dropped or agent died)")
                else:
                    fail = None if ev["code"] == 0 or ev.get("stopped") else Failure(
                        host, ev.get("rank"), ev["code"], ev.get("how", ""), tuple(ev.get("tail", ())))
                if fail is not None and result.first_failure is None and result.interrupted_by is None:
                    result.first_failure = fail
                    result.code = fail.code
                    # the failing node tears itself down; every other node is told now
                    for i in pending - {idx}:
                        links[i].safe_send(STOP)
                    stop_deadline = time.monotonic() + grace + 5
        for link in links:
            link.close()
        self._report(result)
        return result

    def _drain(self, links, pending, deadline) -> None:
        while pending and time.monotonic() < deadline:
            try:
                idx, ev = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if idx is not None and ev.get("ev") in ("done", "eof"):
                pending.discard(idx)
        for link in links:
            link.close()

    def _report(self, result: Attempt) -> None:
        f = result.first_failure
        if f is None:
            return
        who = f"rank {f.rank} on host {f.host}" if f.rank is not None else f"host {f.host}"
        self.sink("err", f"dslaunch: {who} failed first: {f.how or f'exit code {f.code}'}")
        if f.tail:
            self.sink("err", f"dslaunch: last lines of {f.host}:{f.rank}'s stderr:")
            for line in f.tail[-self.tail_lines:]:
                self.sink("err", f"    {line}")

    def _connect(self, hosts: List[str]):
        return connect_all(hosts, self.ssh)

    def _open_links(self, plans: List[NodePlan], clients, links: List[_Link]) -> None:
        """Start one agent per plan, appending each link as soon as it exists."""
        for plan in plans:
            if plan.host in self.local_hosts:
                link: _Link = _LocalLink(plan.host, self.python, self.workdir)
            else:
                link = _SshLink(plan.host, clients[plan.host], self.python, self.workdir)
            links.append(link)
            self._start_readers(len(links) - 1, link)
            link.safe_send(plan.to_json())

    # ------------------------------------------------------------------ readers
    def _start_readers(self, idx: int, link: _Link) -> None:
        events_q = self._events

        def events():
            try:
                for raw in link.out:
                    try:
                        ev = json.loads(raw)
                    except ValueError:
                        ev = {"ev": "agent_err", "text": raw.decode(errors="replace").rstrip("\n")}
                    events_q.put((idx, ev))
            except Exception:
                pass
            events_q.put((idx, {"ev": "eof"}))

        def errors():
            try:
                for raw in link.err:
                    events_q.put((idx, {"ev": "agent_err", "text": raw.decode(errors="replace").rstrip("\n")}))
            except Exception:
                pass

        for target in (events, errors):
            threading.Thread(target=target, daemon=True, name=f"dslaunch-{link.host}").start()


def build_plans(
    world, script: str, script_args: Sequence[str], *, python: str, master_addr: str, master_port: int,
    run_id: str, forwarded: Dict[str, str], max_restarts: int = 0, kill_grace: float = 5.0,
    module: bool = False, no_python: bool = False, no_local_rank: bool = False,
) -> Callable[[int], List[NodePlan]]:
    """World + script -> a function from restart count to every node's plan (pure)."""
    from dslaunch.launcher.world import RunIdentity, worker_argv, worker_env

    def plans(restart: int) -> List[NodePlan]:
        ident = RunIdentity(master_addr, master_port, run_id, restart, max_restarts)
        out = []
        for node in world.nodes:
            workers = []
            for lr in range(node.local_world_size):
                env = dict(forwarded)
                # the contract wins over forwarded values: a stray RANK in .dslaunch_env must not break the job
                env.update(worker_env(world, node, lr, ident))
                del env["DSLAUNCH_ACCELERATOR"]  # each node's agent decides (cuda/cpu) from its own devices
                argv = worker_argv(script, script_args, lr, python=python, module=module,
                                   no_python=no_python, no_local_rank=no_local_rank)
                workers.append(WorkerPlan(node.first_rank + lr, lr, tuple(argv), env))
            target = f"{node.user}@{node.host}" if node.user else node.host
            out.append(NodePlan(node.node_rank, target, tuple(workers), kill_grace))
        return out

    return plans


# ---------------------------------------------------------------------- the CLI's hand-off

def run_plan(plan, mn: MultiNodeOptions, environ: Optional[Dict[str, str]] = None, sink: Sink = default_sink) -> int:
    """Run (or for --dry_run, print) a launch plan (plan.LaunchPlan) that spans other hosts.

    Usage errors raise LaunchConfigError (the CLI prints one line and exits 2).
    """
    try:
        return _run_plan(plan, mn, environ, sink)
    except KeyboardInterrupt:
        # Ctrl-C while connecting or in the preflight, before any worker started
        sink("err", "dslaunch: interrupted before the job started")
        return 130


def _run_plan(plan, mn: MultiNodeOptions, environ: Optional[Dict[str, str]], sink: Sink) -> int:
    import random

    from dslaunch.launcher import preflight
    from dslaunch.launcher.cluster import ClusterError, require_tool
    from dslaunch.launcher.errors import LaunchConfigError
    from dslaunch.launcher.ssh_env import forwarded_env

    from dslaunch.launcher.ssh import SshError, _load_config

    o = plan.options
    try:
        _load_config(mn.ssh.config_path)  # a broken ~/.ssh/config is a usage error, reported once
    except SshError as exc:
        raise LaunchConfigError(str(exc)) from None
    environ = dict(os.environ if environ is None else environ)
    python = mn.remote_python or sys.executable
    workdir = mn.workdir or os.getcwd()
    forwarded = forwarded_env(environ, plan.env_file.values, mn.exports)
    first = plan.world.nodes[0]
    first_target = f"{first.user}@{first.host}" if first.user else first.host
    # the first host's address as SSH resolves it (~/.ssh/config HostName), so workers need no DNS for it
    master = o.master_addr or preflight.default_master_addr(first_target, mn.ssh)
    # --master_port 0: no port can be proven free on another host from here; pick an unlikely one
    port = plan.master_port or random.randint(20000, 40000)
    kw = dict(module=o.module, no_python=o.no_python, no_local_rank=o.no_local_rank)
    try:
        if mn.launcher in ("openmpi", "slurm"):
            # mpirun and srun start the ranks themselves; we only build and run their command
            from dslaunch.launcher.cluster_launch import run_cluster_tool
            return run_cluster_tool(plan.world, o.script, o.script_args, mn, python=python, workdir=workdir,
                                    master_addr=master, master_port=port, forwarded=forwarded,
                                    dry_run=o.dry_run, sink=sink, **kw)
        if mn.launcher == "pdsh" and not o.dry_run:
            require_tool("pdsh")
    except ClusterError as exc:
        raise LaunchConfigError(str(exc)) from None
    plans = build_plans(plan.world, o.script, o.script_args, python=python, master_addr=master, master_port=port,
                        run_id=plan.run_id, forwarded=forwarded, max_restarts=o.max_restarts,
                        kill_grace=o.kill_grace, **kw)
    if o.dry_run:
        sink("out", format_plan(plan, plans(0), python, workdir, mn, set(forwarded), o.json))
        return 0
    local = tuple(f"{n.node.user}@{n.node.host}" if n.node.user else n.node.host for n in plan.nodes if n.local)
    remote = [(p.host, len(p.workers)) for p in plans(0) if p.host not in local]
    # the SSH transport connects once: the preflight probes over the connections the job then uses
    conns = connect_all([h for h, _ in remote], mn.ssh) if mn.launcher == "ssh" else None
    if conns is not None and conns.errors and mn.skip_check:
        conns.close()
        for host, _ in remote:
            if host in conns.errors:
                sink("err", f"dslaunch: {conns.errors[host]}")
        return 255
    if not mn.skip_check:
        reports = preflight.run_preflight(remote, mn.ssh, python, master, port, need_torch=False, connections=conns)
        problem = preflight.summary_line(reports)
        if problem:
            if conns is not None:
                conns.close()
            sink("err", preflight.format_table(reports, f"{master}:{port}"))
            sink("err", f"dslaunch: {problem} (--skip_check to launch anyway)")
            return 255
    if mn.launcher == "pdsh":
        from dslaunch.launcher.cluster_launch import run_pdsh
        return run_pdsh(plans, mn, python=python, workdir=workdir, sink=sink, environ=environ)
    runner = MultiNodeRunner(plans, mn.ssh, python, workdir, local_hosts=local,
                             max_restarts=o.max_restarts, sink=sink, connections=conns)
    logs = None
    if o.log_dir:
        # the head keeps the logs: every rank's lines arrive here anyway, whatever host ran it
        from types import SimpleNamespace

        from dslaunch.launcher.output import LogDirSink
        logs = LogDirSink(o.log_dir, list(range(plan.world.world_size)), f"run {plan.run_id}")
        runner.line_log = lambda rank, stream, text: logs(SimpleNamespace(rank=rank), stream, text.encode() + b"\n")
    try:
        return runner.run()
    finally:
        if logs is not None:
            logs.close()


def format_plan(launch_plan, plans: List[NodePlan], python: str, workdir: str, mn: MultiNodeOptions,
                secret_names, as_json: bool) -> str:
    """--dry_run for a multi-host layout: the single-node plan's shape (plan.plan_to_dict),
    with each remote worker's real environment (forwarded values *** unless --show_env),
    the transport, and the agent command each host runs."""
    from dslaunch.launcher.plan import plan_to_dict
    from dslaunch.launcher.ssh_env import MASK, masked

    d = plan_to_dict(launch_plan)
    d["master_addr"], d["master_port"] = plans[0].workers[0].env["MASTER_ADDR"], int(plans[0].workers[0].env["MASTER_PORT"])
    d["launcher"] = mn.launcher
    for node, p in zip(d["nodes"], plans):
        if not node["local"]:
            node["agent"] = agent_command(python, workdir)
        for w, wp in zip(node["workers"], p.workers):
            w["argv"] = list(wp.argv)
            w["env"] = masked(wp.env, secret_names, mn.show_env)
    if as_json:
        return json.dumps(d, indent=2)
    out = [f"dslaunch plan: {d['num_nodes']} node(s), world size {d['world_size']}, "
           f"master {d['master_addr']}:{d['master_port']}, run id {d['run_id']}, max restarts {d['max_restarts']}, "
           f"launcher {mn.launcher}"]
    if d["env_file"]:
        out.append(f"env file: {d['env_file']}")
    for n in d["nodes"]:
        who = f"{n['user']}@{n['host']}" if n["user"] else n["host"]
        where = "this machine" if n["local"] else f"remote: {n['agent']}"
        out.append(f"node {n['node_rank']}: {who} ({where}) slots {','.join(map(str, n['slots']))} "
                   f"ranks {n['ranks'][0]}-{n['ranks'][-1]}")
        for w in n["workers"]:
            out.append(f"  rank {w['rank']} (local {w['local_rank']}): {shlex.join(w['argv'])}")
            out.append("    env: " + " ".join(f"{k}={v if v == MASK else shlex.quote(v)}"
                                          for k, v in sorted(w["env"].items())))
    return "\n".join(out)
