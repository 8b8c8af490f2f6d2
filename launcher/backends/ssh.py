"""`--launcher ssh` (the default): one node agent per host over SSH, on paramiko.

All hosts are connected at once (ssh.connect_all); the preflight (unless --skip_check)
probes over those same connections, and each attempt opens one session per host on them
running `cd WORKDIR && exec PYTHON -u -m dslaunch.launcher.agent`. The request travels on
the session's stdin, so no argument or value ever reaches a remote command line, and the
heartbeat pings and the stop follow it there.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, List, Sequence

from dslaunch.launcher.backends import agent_command
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.head import AgentLink, Head, LocalLink
from dslaunch.launcher.protocol import AgentRequest


class SshLink(AgentLink):
    """No write_nowait: paramiko's send may wait for a rekey or a full socket even when the
    channel's window is open, so every send goes through the link's sender thread."""

    def __init__(self, host: str, client, python: str, workdir: str):
        super().__init__(host)
        self._client = client
        self._command = agent_command(python, workdir)
        self._chan = None

    def start(self, post: Callable[[dict], None], request: AgentRequest) -> None:
        self._chan = self._client.get_transport().open_session()
        self._chan.exec_command(self._command)
        for target, stream in ((self.read_events, self._chan.makefile("rb")),
                               (self.read_errors, self._chan.makefile_stderr("rb"))):
            threading.Thread(target=target, args=(stream, post), daemon=True, name=f"dslaunch-{self.host}").start()
        self.send(request.to_line())

    def write(self, data: bytes) -> None:
        self._chan.sendall(data)

    def close(self) -> None:
        if self._chan is not None:
            try:
                self._chan.close()
            except Exception:
                pass


def check_ssh_config(config_path=None) -> None:
    """A broken ~/.ssh/config is a usage error, said once before anything starts."""
    from dslaunch.launcher.ssh import SshError, load_config

    try:
        load_config(config_path)
    except SshError as exc:
        raise LaunchConfigError(str(exc)) from None


def remote_agents(plan) -> Dict[str, str]:
    return {n.target: agent_command(plan.remote_python, plan.workdir) for n in plan.remote_nodes}


class SshBackend:
    name = "ssh"
    summary = "one node agent per host over SSH (paramiko, built in)"

    def check(self, plan) -> None:
        check_ssh_config()

    def describe(self, plan) -> Dict[str, Any]:
        return {"agents": remote_agents(plan)}

    def run(self, plan, output, err_fd) -> int:
        from dslaunch.launcher import preflight
        from dslaunch.launcher.ssh import connect_all

        o = plan.options
        remote = [n.target for n in plan.remote_nodes]
        conns = connect_all(remote, o.ssh)
        if plan.elastic is not None:
            try:
                return run_elastic(plan, output, err_fd, conns)
            finally:
                conns.close()
        try:
            if conns.errors and o.skip_check:
                for host in remote:
                    if host in conns.errors:
                        output.say(str(conns.errors[host]))
                return 255
            if not o.skip_check and not preflight.before_launch(plan, output, conns):
                return 255

            def open_links(nodes: Sequence) -> List[AgentLink]:
                return [LocalLink(n.target, sys.executable, plan.workdir) if n.local
                        else SshLink(n.target, conns.clients[n.target], plan.remote_python, plan.workdir)
                        for n in nodes]

            return Head(plan, open_links, output, err_fd).run()
        finally:
            conns.close()


class _Clients:
    """An elastic job's SSH connections: made again for a host that comes back (thread-safe:
    the prober connects while the head starts agents)."""

    def __init__(self, conns, opts):
        self._clients = dict(conns.clients)
        self._opts = opts
        self._lock = threading.Lock()

    def get(self, target: str):
        """A live connection to target, made now if needed; SshError naming the host if not."""
        from dslaunch.launcher.ssh import SshError, connect, resolve

        with self._lock:
            client = self._clients.get(target)
        transport = client.get_transport() if client is not None else None
        if transport is not None and transport.is_active():
            return client
        try:
            client = connect(resolve(target, self._opts), self._opts)
        except SshError as exc:
            exc.host = target  # how the head names the host (user@host)
            raise
        with self._lock:
            old, self._clients[target] = self._clients.get(target), client
        if old is not None:
            old.close()
        return client

    def probe(self, target: str) -> bool:
        """Whether target answers now (connect and authenticate); the connection is kept for the start."""
        from dslaunch.launcher.ssh import SshError

        with self._lock:
            old = self._clients.pop(target, None)
        if old is not None:
            old.close()  # a connection from before the host went away tells nothing
        try:
            self.get(target)
            return True
        except SshError:
            return False

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


def _elastic_start(plan, output, conns):
    """The hosts that answer and pass the preflight, if at least --min_nodes do: (plan on them,
    {target: why for the others}), or None (said why)."""
    from dslaunch.launcher import preflight

    spec, o = plan.elastic, plan.options
    away = {h: str(e) for h, e in conns.errors.items()}
    while True:
        keep = [n.target for n in plan.nodes if n.target not in away]
        if len(keep) < spec.min_nodes:
            for why in away.values():
                output.say(why)
            output.say(f"only {len(keep)} of {len(plan.nodes)} host(s) can start, below --min_nodes {spec.min_nodes}")
            return None
        if len(keep) < len(plan.nodes):
            plan = plan.replan(keep)
        if o.skip_check:
            return plan, away
        slots = {n.target: n.node.local_world_size for n in plan.remote_nodes}
        reports = preflight.run_preflight(list(slots.items()), o.ssh, plan.remote_python, plan.master_addr,
                                          plan.master_port, need_torch=False, connections=conns)
        bad = {r.host: f"{r.host}: {'; '.join(r.problems)}" for r in reports if not r.ok}
        if not bad:
            return plan, away
        away.update(bad)


def run_elastic(plan, output, err_fd, conns) -> int:
    from dslaunch.launcher.elastic_head import ElasticHead

    started = _elastic_start(plan, output, conns)
    if started is None:
        return 255
    plan, away = started
    for why in away.values():
        output.say(f"{why}: starting without it; it joins when it answers")
    clients = _Clients(conns, plan.options.ssh)

    def open_links(nodes: Sequence) -> List[AgentLink]:
        return [LocalLink(n.target, sys.executable, plan.workdir) if n.local
                else SshLink(n.target, clients.get(n.target), plan.remote_python, plan.workdir)
                for n in nodes]

    try:
        return ElasticHead(plan, open_links, output, err_fd, rebuild=plan.replan, pool=plan.hosts_now,
                           probe=clients.probe, away={h: "lost" for h in away}).run()
    finally:
        clients.close()


BACKEND = SshBackend()
