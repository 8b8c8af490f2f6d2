"""`--launcher pdsh`: the node agents are started by one pdsh process instead of paramiko.

pdsh gives remote commands no stdin, and anything on their command line is readable by
every local user in /proc/*/cmdline, on the head and on each node. So:
- each node's request (its workers' argv and env, secrets included) goes into a file
  readable only by the user, under `WORKDIR/.dslaunch/`, which the agent removes as soon
  as it has read it. The working directory must therefore be the same directory on every
  host (a shared filesystem), as DeepSpeed's pdsh launcher also assumes; an agent that
  cannot find its file says so and the job stops;
- the working directory may be one other users can write, so `.dslaunch` is trusted only
  as a real directory of ours, made 0700, opened once without following a link, and each
  request file is created in it with O_EXCL|O_NOFOLLOW (private_files.py); a planted
  `.dslaunch` link or another user's directory is refused in one line before anything
  starts. The agent checks the folder and the file the same way before reading them;
- the file also holds a TCP port on the head and a one-time token: the agent connects back
  (to the address in $SSH_CONNECTION, i.e. the head as the node sees it) and the heartbeat
  pings and the stop travel over that socket, since pdsh has no stdin to carry them. The
  token itself never crosses the network: each side proves it knows it with an HMAC,
  keyed by the token, of a fresh nonce the agent picks (protocol.py), the agent first;
  the agent runs nothing until the head has proved it, so a listener that took the port
  over gets no token and starts no worker.
The agents' events come back through pdsh's `host: line` output and are demultiplexed per
node; supervision is then the same Head as for ssh.
"""
from __future__ import annotations

import hmac
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from dslaunch.launcher.backends import require_tool, split_args
from dslaunch.launcher.hostfile import split_user
from dslaunch.launcher.head import AgentLink, Head, LocalLink
from dslaunch.launcher.private_files import create_private, open_private_dir
from dslaunch.launcher.protocol import AgentRequest, control_proof, decode, encode

REQUEST_DIR = ".dslaunch"
CONNECT_TIMEOUT = 60.0  # an agent that has not connected back by then is reported by the heartbeat anyway


def _quote(word: str) -> str:
    # pdsh substitutes %h/%u/%n everywhere in the command, so a literal % must be doubled
    return shlex.quote(word).replace("%", "%%")


def pdsh_argv(hosts: Sequence[str], remote: str, launcher_args: str) -> List[str]:
    for h in hosts:
        if "," in h:
            raise ValueError(f"pdsh: host name {h!r} contains a comma")
    return ["pdsh", "-S", "-R", "ssh", "-f", str(len(hosts)), "-w", ",".join(hosts), *split_args(launcher_args),
            remote]


def remote_command(python: str, workdir: str, request_path: str) -> str:
    """`cd WORKDIR && exec PYTHON -u -m dslaunch.launcher.agent --request_file PATH`, %-escaped;
    `%n` in the path becomes each host's index in the -w list."""
    agent = f"{_quote(python)} -u -m dslaunch.launcher.agent --request_file {_quote(request_path)}"
    return f"cd {_quote(workdir)} && exec {agent}".replace("%%n", "%n")


def ssh_args_env(opts, environ: Dict[str, str]) -> Dict[str, str]:
    """pdsh's ssh gets our --ssh_* options through PDSH_SSH_ARGS_APPEND."""
    env = dict(environ)
    env["PDSH_RCMD_TYPE"] = "ssh"
    extra = shlex.split(env.get("PDSH_SSH_ARGS_APPEND", ""))
    if opts.ssh_key:
        extra += ["-i", opts.ssh_key]
    if opts.ssh_port:
        extra += ["-p", str(opts.ssh_port)]
    if opts.ssh_user:
        extra += ["-l", opts.ssh_user]
    extra += ["-o", f"ConnectTimeout={int(max(1, opts.ssh_timeout))}", "-o", "BatchMode=yes"]
    if opts.accept_new_host_keys:
        extra += ["-o", "StrictHostKeyChecking=accept-new"]
    env["PDSH_SSH_ARGS_APPEND"] = shlex.join(extra)
    return env


class _PdshGroup:
    """One pdsh process carrying every remote node's agent, and the control listener."""

    def __init__(self, plan, attempt_tag: str):
        self.plan = plan
        self.links: List["PdshLink"] = []
        self.dir = Path(plan.workdir) / REQUEST_DIR
        self.dir_fd = open_private_dir(str(self.dir), "the pdsh request folder")
        self.pattern = str(self.dir / f"request-{attempt_tag}-%n.json")
        self.server = socket.create_server(("", 0))
        self.port = self.server.getsockname()[1]
        self.proc: Optional[subprocess.Popen] = None
        self._started = 0
        self._finished = False
        self._lock = threading.Lock()

    def request_path(self, index: int) -> str:
        return self.pattern.replace("%n", str(index))

    def write_request(self, index: int, body: bytes) -> None:
        path = self.request_path(index)
        create_private(self.dir_fd, os.path.basename(path), body, path)

    def link_started(self) -> None:
        with self._lock:
            self._started += 1
            if self._started < len(self.links):
                return
        self._spawn()

    def _spawn(self) -> None:
        from dslaunch.launcher.reaper import make_child_setup

        o = self.plan.options
        argv = pdsh_argv([link.host for link in self.links],
                         remote_command(self.plan.remote_python, self.plan.workdir, self.pattern), o.launcher_args)
        # own session: ending pdsh ends its ssh clients too; parent-death signal: a SIGKILLed head takes it along
        self.proc = subprocess.Popen(argv, env=ssh_args_env(o, dict(os.environ)), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=make_child_setup())
        by_host = {split_user(link.host)[1]: link for link in self.links}
        threading.Thread(target=self._demux, args=(by_host,), daemon=True, name="dslaunch-pdsh-out").start()
        threading.Thread(target=self._errors, args=(by_host,), daemon=True, name="dslaunch-pdsh-err").start()
        threading.Thread(target=self._accept, daemon=True, name="dslaunch-pdsh-control").start()

    def _demux(self, by_host: Dict[str, "PdshLink"]) -> None:
        for raw in self.proc.stdout:
            host, sep, rest = raw.partition(b": ")
            link = by_host.get(host.decode(errors="replace"))
            if link is None or not sep:
                continue
            link.post(decode(rest) or {"ev": "agent_err", "text": rest.decode("utf-8", "replace").rstrip("\n")})
        self.proc.wait()
        for link in self.links:
            link.post({"ev": "eof"})  # the head ignores it for nodes already done

    def _errors(self, by_host: Dict[str, "PdshLink"]) -> None:
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if "exited with exit code" in line:  # repeats what the agent's done event says
                continue
            text = line.split("@", 1)[-1] if line.startswith("pdsh@") else line
            host = text.split(": ", 1)[0].strip()
            target = by_host.get(host) or self.links[0]
            target.post({"ev": "agent_err", "text": line})

    def _accept(self) -> None:
        pending = {link.token: link for link in self.links}
        while not all(link.connected.is_set() for link in self.links):
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.settimeout(10)
            try:
                hello = decode(conn.makefile("rb").readline()) or {}
            except OSError:
                hello = {}
            nonce, proof = str(hello.get("nonce", "")), str(hello.get("proof", ""))
            link = next((link for token, link in pending.items()
                         if nonce and hmac.compare_digest(proof, control_proof(token, "agent", nonce))), None)
            if link is None:
                conn.close()  # not one of ours, or a token used twice
                continue
            del pending[link.token]
            try:  # our half: the agent runs nothing until it has this
                conn.sendall(encode({"proof": control_proof(link.token, "head", nonce)}))
            except OSError:
                conn.close()
                continue
            conn.settimeout(None)
            link.sock = conn
            link.connected.set()

    def finish(self) -> None:
        with self._lock:  # the last two links may close at once: the folder's descriptor is closed once
            if self._finished:
                return
            self._finished = True
        self.server.close()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait()
        for i in range(len(self.links)):
            try:  # an agent that never started leaves its file
                os.unlink(os.path.basename(self.request_path(i)), dir_fd=self.dir_fd)
            except OSError:
                pass
        os.close(self.dir_fd)


class PdshLink(AgentLink):
    def __init__(self, host: str, group: _PdshGroup, index: int):
        super().__init__(host)
        self.group = group
        self.index = index
        self.token = secrets.token_hex(16)
        self.sock: Optional[socket.socket] = None
        self.connected = threading.Event()
        self.post: Callable[[dict], None] = lambda ev: None
        self._closed = False

    def start(self, post: Callable[[dict], None], request: AgentRequest) -> None:
        self.post = post
        body = encode({"request": request.to_dict(), "control": {"port": self.group.port, "token": self.token}})
        self.group.write_request(self.index, body)
        self.group.link_started()

    def write_nowait(self, data: bytes) -> int:
        """Once the agent has connected back; before that, the sender thread waits for it."""
        if not self.connected.is_set() or self.sock is None:
            return 0
        try:
            return self.sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0

    def write(self, data: bytes) -> None:
        if not self.connected.wait(CONNECT_TIMEOUT) or self.sock is None:
            raise ConnectionError("the agent never connected back")
        self.sock.sendall(data)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
                self.sock.close()
            except OSError:
                pass
        if all(link._closed for link in self.group.links):
            self.group.finish()


class PdshBackend:
    name = "pdsh"
    summary = "one node agent per host, started by pdsh (DeepSpeed's default launcher)"

    def check(self, plan) -> None:
        for n in plan.remote_nodes:
            if "," in n.target:
                from dslaunch.launcher.errors import LaunchConfigError
                raise LaunchConfigError(f"--launcher pdsh: host name {n.target!r} contains a comma")
        split_args(plan.options.launcher_args)
        require_tool("pdsh", "pdsh", self.name)
        os.close(open_private_dir(str(Path(plan.workdir) / REQUEST_DIR), "the pdsh request folder"))

    def describe(self, plan) -> Dict[str, Any]:
        pattern = str(Path(plan.workdir) / REQUEST_DIR / "request-RUN-%n.json")
        hosts = [n.target for n in plan.remote_nodes]
        return {"command": pdsh_argv(hosts, remote_command(plan.remote_python, plan.workdir, pattern),
                                     plan.options.launcher_args)}

    def run(self, plan, output, err_fd) -> int:
        from dslaunch.launcher import preflight

        if not plan.options.skip_check and not preflight.before_launch(plan, output):
            return 255
        attempt = [0]

        def open_links(nodes: Sequence) -> List[AgentLink]:
            group = _PdshGroup(plan, f"{plan.run_id}-{attempt[0]}-{secrets.token_hex(4)}")
            attempt[0] += 1
            links: List[AgentLink] = []
            for n in nodes:
                if n.local:
                    links.append(LocalLink(n.target, sys.executable, plan.workdir))
                else:
                    link = PdshLink(n.target, group, len(group.links))
                    group.links.append(link)
                    links.append(link)
            return links

        return Head(plan, open_links, output, err_fd).run()


BACKEND = PdshBackend()
