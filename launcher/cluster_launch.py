"""Running a job through pdsh, mpirun or srun (`--launcher pdsh|openmpi|slurm`).

pdsh starts the same node agent as `--launcher ssh`, so supervision is unchanged: the
agents' JSON events come back through pdsh's `host: line` output and are demultiplexed
per node. pdsh gives the remote commands no stdin, so stopping means ending pdsh (and
its ssh clients): each agent then fails its next heartbeat write and tears its workers
down. mpirun and srun supervise the ranks themselves; we build their command line
(cluster.py), print it, and run it with its exit code passed through.
"""
from __future__ import annotations

import base64
import json
import os
import shlex
import signal
import subprocess
import threading
from typing import Dict, List, Sequence

from dslaunch.launcher.cluster import ClusterJob, openmpi_command, pdsh_command, require_tool, slurm_command
from dslaunch.launcher.multinode import MultiNodeRunner, NodePlan, _Link
from dslaunch.launcher.ssh import ConnectResult, split_user


class _PdshProcess:
    """One pdsh process carrying every node's agent."""

    def __init__(self, argv: List[str], env: Dict[str, str]):
        from dslaunch.launcher.reaper import make_child_setup

        # Own session, so stop() can end pdsh and its ssh clients as one group; parent-death
        # signal, so a SIGKILLed head still takes pdsh down. The ssh clients then fail on their
        # next write, each agent's heartbeat write fails after that, and the agent stops its workers.
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, preexec_fn=make_child_setup())
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


class _PdshLink(_Link):
    def __init__(self, host: str, group: _PdshProcess):
        super().__init__(host)
        self.group = group

    def send(self, text: str) -> None:
        if json.loads(text).get("cmd") == "stop":
            self.group.stop()

    def close(self) -> None:
        pass


class PdshRunner(MultiNodeRunner):
    """MultiNodeRunner whose agents pdsh starts instead of paramiko."""

    launcher_args: str = ""
    pdsh_env: Dict[str, str] = None

    def _connect(self, hosts):
        return ConnectResult()  # pdsh connects itself

    def _open_links(self, plans: List[NodePlan], clients, links: List[_Link]) -> None:
        blob = base64.b64encode(json.dumps([json.loads(p.to_json()) for p in plans]).encode()).decode()
        agent = [self.python, "-u", "-m", "dslaunch.launcher.agent", "--plan", blob]
        job = ClusterJob(hosts=[(p.host, len(p.workers)) for p in plans], worker_argv=[],
                         workdir=self.workdir, launcher_args=self.launcher_args)
        group = _PdshProcess(pdsh_command(job, agent).argv, self.pdsh_env)
        by_host: Dict[str, int] = {}
        for plan in plans:
            by_host[split_user(plan.host)[1]] = len(links)
            links.append(_PdshLink(plan.host, group))

        events_q = self._events

        def events():
            seen_done = set()
            for raw in group.proc.stdout:
                host, sep, rest = raw.decode(errors="replace").rstrip("\n").partition(": ")
                idx = by_host.get(host)
                if idx is None or not sep:
                    continue
                try:
                    ev = json.loads(rest)
                except ValueError:
                    ev = {"ev": "agent_err", "text": rest}
                if ev.get("ev") == "done":
                    seen_done.add(idx)
                events_q.put((idx, ev))
            group.proc.wait()
            for idx in range(len(plans)):
                if idx not in seen_done:
                    events_q.put((idx, {"ev": "eof"}))

        def errors():
            for raw in group.proc.stderr:
                line = raw.decode(errors="replace").rstrip("\n")
                # pdsh's own "host: ssh exited with exit code N" repeats what the done event says
                if "exited with exit code" not in line:
                    events_q.put((0, {"ev": "agent_err", "text": line}))

        for target in (events, errors):
            threading.Thread(target=target, daemon=True, name="dslaunch-pdsh").start()


def _pdsh_env(opts, environ: Dict[str, str]) -> Dict[str, str]:
    env = dict(environ)
    env["PDSH_RCMD_TYPE"] = "ssh"
    extra = shlex.split(env.get("PDSH_SSH_ARGS_APPEND", ""))
    if opts.ssh.key:
        extra += ["-i", opts.ssh.key]
    if opts.ssh.port:
        extra += ["-p", str(opts.ssh.port)]
    if opts.ssh.user:
        extra += ["-l", opts.ssh.user]
    extra += ["-o", f"ConnectTimeout={int(max(1, opts.ssh.timeout))}", "-o", "BatchMode=yes"]
    if opts.ssh.accept_new_host_keys:
        extra += ["-o", "StrictHostKeyChecking=accept-new"]
    env["PDSH_SSH_ARGS_APPEND"] = shlex.join(extra)
    return env


def run_pdsh(plans_for, opts, *, python: str, workdir: str, sink, environ: Dict[str, str]) -> int:
    runner = PdshRunner(plans_for, opts.ssh, python, workdir, sink=sink)
    runner.launcher_args = opts.launcher_args
    runner.pdsh_env = _pdsh_env(opts, environ)
    return runner.run()


def run_cluster_tool(world, script: str, script_args: Sequence[str], opts, *, python: str, workdir: str,
                     master_addr: str, master_port: int, forwarded: Dict[str, str], module: bool,
                     no_python: bool, no_local_rank: bool, dry_run: bool, sink) -> int:
    from dslaunch.launcher.ssh_env import MASK, masked
    from dslaunch.launcher.world import worker_argv

    # the rank's LOCAL_RANK is known only when mpirun/srun start it: the shim adds --local_rank
    argv = worker_argv(script, script_args, 0, python=python, module=module, no_python=no_python,
                       no_local_rank=True)
    local_rank_at = None if no_local_rank else len(argv) - len(script_args)
    hosts = [((f"{n.user}@{n.host}" if n.user else n.host), n.local_world_size) for n in world.nodes]
    job = ClusterJob(hosts=hosts, worker_argv=argv, env=forwarded, master_addr=master_addr,
                     master_port=master_port, workdir=workdir, python=python, launcher_args=opts.launcher_args,
                     local_rank_at=local_rank_at)
    cmd = openmpi_command(job) if opts.launcher == "openmpi" else slurm_command(job)
    if not dry_run:
        require_tool(opts.launcher)
    shown = masked(cmd.env, forwarded, opts.show_env)
    sink("err" if not dry_run else "out",
         " ".join(f"{k}={v if v == MASK else shlex.quote(v)}" for k, v in sorted(shown.items()))
         + " " + shlex.join(cmd.argv))
    if dry_run:
        return 0
    proc = subprocess.run(cmd.argv, env={**os.environ, **cmd.env})
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
