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


BACKEND = SshBackend()
