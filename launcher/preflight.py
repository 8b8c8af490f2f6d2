"""Preflight: can this job start on these hosts? `dslaunch check --hostfile H`.

For every host, in parallel: connect over SSH (timed), run one short Python probe with
the interpreter the workers will use, and report its version, torch's version (read from
the package metadata, because importing torch costs seconds), the number of NVIDIA GPUs
against the host's slots, and whether the master address answers from that host.

"Answers" means a TCP connect to MASTER_ADDR:MASTER_PORT either succeeds or is refused:
before the job starts nobody listens on the port, and a refusal still proves the address
routes to a live machine. A timeout or "no route" means the workers would hang in
rendezvous, which is what this check exists to catch.

The same check runs, briefly, before every multi-node launch unless --skip_check.

With `--launcher openmpi` or `--launcher slurm` the probe is started the way the job will
be, by mpirun or srun (one task per host), so it also proves that the tool reaches every
host; inside a Slurm allocation the hosts are the allocation's when no hostfile is given.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import click
import paramiko

from dslaunch.launcher.cli import option, ssh_options
from dslaunch.launcher.options import DEFAULT_MASTER_PORT, SshOptions
from dslaunch.launcher.ssh import SshError, connect, load_config, resolve

# Runs on the remote host under the workers' interpreter; reads its parameters from stdin, or
# from DSLAUNCH_PROBE_ARGS where mpirun/srun start it (they give stdin to one task only).
_PROBE = r"""
import json, os, socket, sys, errno
args = json.loads(os.environ.get("DSLAUNCH_PROBE_ARGS") or sys.stdin.readline())
out = {"python": sys.version.split()[0], "executable": sys.executable, "host": socket.gethostname(),
       "task": os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("SLURM_PROCID"))}
try:
    from importlib.metadata import version
    out["torch"] = version("torch")
except Exception:
    out["torch"] = None
gpus = 0
try:
    gpus = len([d for d in os.listdir("/proc/driver/nvidia/gpus")])
except OSError:
    pass
out["gpus"] = gpus
addr, port = args["master_addr"], args["master_port"]
try:
    s = socket.create_connection((addr, port), timeout=args["timeout"])
    s.close()
    out["master"] = "ok"
except ConnectionRefusedError:
    out["master"] = "ok"
except socket.timeout:
    out["master"] = "timed out"
except socket.gaierror as e:
    out["master"] = "cannot resolve"
except OSError as e:
    out["master"] = e.strerror or str(e)
print("DSLAUNCH_PROBE " + json.dumps(out), flush=True)
"""


@dataclass
class HostReport:
    host: str
    slots: int
    reachable: bool = False
    latency_ms: Optional[float] = None
    python: Optional[str] = None
    torch: Optional[str] = None
    gpus: Optional[int] = None
    master: Optional[str] = None
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def probe_host(
    host: str, slots: int, opts: SshOptions, python: str, master_addr: str, master_port: int,
    need_torch: bool = True, config: Optional[paramiko.SSHConfig] = None,
    client: Optional[paramiko.SSHClient] = None, connect_ms: Optional[float] = None,
) -> HostReport:
    """Probe one host; with `client` given (the launch's own connection) it is reused, not closed."""
    rep = HostReport(host=host, slots=slots)
    own = client is None
    t0 = time.perf_counter()
    if own:
        try:
            client = connect(resolve(host, opts, config), opts)
        except SshError as exc:
            rep.problems.append(str(exc).split(": ", 1)[1])
            return rep
        connect_ms = (time.perf_counter() - t0) * 1e3
    rep.reachable = True
    rep.latency_ms = connect_ms
    try:
        stdin, stdout, stderr = client.exec_command(f"{shlex.quote(python)} -c {shlex.quote(_PROBE)}", timeout=opts.timeout + 10)
        stdin.write(json.dumps({"master_addr": master_addr, "master_port": master_port,
                                "timeout": min(3.0, opts.timeout)}) + "\n")
        stdin.flush()
        stdin.channel.shutdown_write()
        out = stdout.read().decode(errors="replace")
        err = stderr.read().decode(errors="replace")
        status = stdout.channel.recv_exit_status()
    except Exception as exc:  # a channel dying half-way is the host's problem, reported as such
        rep.problems.append(f"probe failed: {exc or type(exc).__name__}")
        if own:
            client.close()
        return rep
    if own:
        client.close()
    return _read_probe(rep, python, status, out, err, need_torch, master_addr, master_port)


def _read_probe(rep: HostReport, python: str, status: int, out: str, err: str, need_torch: bool,
                master_addr: str, master_port: int) -> HostReport:
    line = next((ln for ln in out.splitlines() if ln.startswith("DSLAUNCH_PROBE ")), None)
    if status != 0 or line is None:
        last = (err.strip().splitlines() or ["no output"])[-1]
        rep.problems.append(f"python {python} did not run (exit {status}): {last}")
        return rep
    info = json.loads(line.split(" ", 1)[1])
    rep.python, rep.torch, rep.gpus, rep.master = info["python"], info["torch"], info["gpus"], info["master"]
    if need_torch and not rep.torch:
        rep.problems.append(f"torch is not installed for {python}")
    if rep.gpus and rep.gpus < rep.slots:
        rep.problems.append(f"slots={rep.slots} but only {rep.gpus} GPU(s)")
    if rep.master != "ok":
        rep.problems.append(f"master {master_addr}:{master_port} {rep.master}")
    return rep


def run_preflight(
    hosts: Sequence[tuple], opts: SshOptions, python: str, master_addr: str, master_port: int,
    need_torch: bool = True, connections=None,
) -> List[HostReport]:
    """hosts: (ssh target, slots) pairs; returns one report per host, in order.

    `connections` (ssh.ConnectResult) lets a launch probe over the connections it then uses.
    """
    config = load_config(opts.config_path)
    if not hosts:
        return []
    clients = connections.clients if connections is not None else {}
    times = connections.connect_ms if connections is not None else {}
    failed = connections.errors if connections is not None else {}

    def one(host: str, slots: int) -> HostReport:
        if host in failed:  # the caller already tried; do not pay its timeout twice
            return HostReport(host=host, slots=slots, problems=[str(failed[host]).split(": ", 1)[1]])
        return probe_host(host, slots, opts, python, master_addr, master_port, need_torch, config,
                          clients.get(host), times.get(host))

    with ThreadPoolExecutor(max_workers=min(64, len(hosts))) as pool:
        futs = [pool.submit(one, h, s) for h, s in hosts]
        return [f.result() for f in futs]


def format_table(reports: Sequence[HostReport], master: str) -> str:
    head = ["host", "reachable", "ssh ms", "python", "torch", "gpus/slots", f"master {master}", "status"]
    rows = []
    for r in reports:
        gpus = "-" if r.gpus is None else (f"{r.gpus}/{r.slots}" if r.gpus else f"0/{r.slots} (cpu)")
        rows.append([
            r.host, "yes" if r.reachable else "NO",
            "-" if r.latency_ms is None else f"{r.latency_ms:.0f}",
            r.python or "-", r.torch or "-", gpus, r.master or "-",
            "ok" if r.ok else "FAIL: " + "; ".join(r.problems),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(r) for r in rows])


def summary_line(reports: Sequence[HostReport]) -> Optional[str]:
    bad = [r for r in reports if not r.ok]
    if not bad:
        return None
    return "preflight failed on " + ", ".join(f"{r.host} ({'; '.join(r.problems)})" for r in bad)


def before_launch(plan, output, connections=None) -> bool:
    """The short check before a multi-node launch; False (and the table said) when a host fails it."""
    slots = {n.target: n.node.local_world_size for n in plan.remote_nodes}
    reports = run_preflight(list(slots.items()), plan.options.ssh, plan.remote_python, plan.master_addr,
                            plan.master_port, need_torch=False, connections=connections)
    problem = summary_line(reports)
    if problem:
        output.say(format_table(reports, f"{plan.master_addr}:{plan.master_port}"))
        output.say(f"{problem} (--skip_check to launch anyway)")
    return problem is None


def local_probe(host: str, slots: int, python: str, master_addr: str, master_port: int, timeout: float,
                need_torch: bool = True) -> HostReport:
    """The same probe for a host that is this machine: run here, no SSH to localhost:22."""
    import subprocess

    rep = HostReport(host=host, slots=slots, reachable=True)
    try:
        res = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout + 30,
                             input=json.dumps({"master_addr": master_addr, "master_port": master_port,
                                               "timeout": min(3.0, timeout)}) + "\n")
    except (OSError, subprocess.TimeoutExpired) as exc:
        rep.problems.append(f"python {python} did not run: {exc}")
        return rep
    return _read_probe(rep, python, res.returncode, res.stdout, res.stderr, need_torch, master_addr, master_port)


def tool_probe(launcher: str, hosts: Sequence[tuple], opts, python: str, master_addr: str,
               master_port: int) -> List[HostReport]:
    """Run the probe on every host through mpirun or srun, one task per host, in one go."""
    import subprocess

    from dslaunch.launcher import backends

    backend = backends.get(launcher)
    argv, env = backend.probe_command([h for h, _ in hosts], opts, os.environ)
    env["DSLAUNCH_PROBE_ARGS"] = json.dumps({"master_addr": master_addr, "master_port": master_port,
                                             "timeout": min(3.0, opts.ssh_timeout)})
    reports = [HostReport(host=h, slots=n) for h, n in hosts]
    try:
        res = subprocess.run([*argv, python, "-c", _PROBE], env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=opts.ssh_timeout + 60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        for rep in reports:
            rep.problems.append(f"{argv[0]} did not finish: {exc}")
        return reports
    found = {}
    for line in res.stdout.splitlines():
        if line.startswith("DSLAUNCH_PROBE "):
            try:
                info = json.loads(line.split(" ", 1)[1])
            except ValueError:
                continue  # a line the tool cut or mixed with another task's: that host counts as silent
            found[backend.probe_host_index(info, [h for h, _ in hosts])] = line
    last = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
    for i, rep in enumerate(reports):
        if i not in found:
            rep.problems.append(f"no answer through {argv[0]} ({last})")
            continue
        rep.reachable = True
        _read_probe(rep, python, 0, found[i], "", True, master_addr, master_port)
    return reports


@click.command(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "DSLAUNCH",
                                 "max_content_width": 100})
@option("-H", "--hostfile", default=None,
        help="MPI-style hostfile: `[user@]host slots=N` per line (with --launcher slurm inside an allocation: "
             "default its nodes).")
@option("--launcher", type=click.Choice(["ssh", "openmpi", "slurm"]), default="ssh", show_default=True,
        help="Probe over SSH, or start the probe the way the job starts: through mpirun or srun.")
@option("--master_addr", default=None, help="Rendezvous address (default: 127.0.0.1 on one machine, else the first host).")
@option("--master_port", type=int, default=DEFAULT_MASTER_PORT, show_default=True)
@ssh_options
def check(hostfile, launcher, master_addr, master_port, **kw):
    """Check every host of HOSTFILE: SSH, Python, torch, GPUs vs slots, master reachability.

    Hosts that are this machine are probed here, without SSH (with --launcher openmpi or
    slurm, every host is probed through mpirun or srun). The SSH options and their
    DSLAUNCH_* variables are the launch's own.
    """
    from dslaunch.launcher.errors import LaunchConfigError
    from dslaunch.launcher.machine import gather_facts, is_local
    from dslaunch.launcher.options import LaunchOptions
    from dslaunch.launcher.plan import resolve_hosts, uses_allocation

    try:
        opts = LaunchOptions(script="-", hostfile=hostfile, master_port=master_port, launcher=launcher, **kw)
        if not hostfile and not uses_allocation(opts, os.environ):
            raise LaunchConfigError("--hostfile is required (or --launcher slurm inside a Slurm allocation)")
        facts = gather_facts(os.environ, need_addresses=True)
        hosts = resolve_hosts(opts, facts, os.environ)
        local = set() if launcher != "ssh" else {h.ssh_target for h in hosts if is_local(h.host, facts.hostnames)}
        first = hosts[0].ssh_target
        master = master_addr or ("127.0.0.1" if len(local) == len(hosts) else
                                 first.rpartition("@")[2] if first in local else resolve(first, opts.ssh).hostname)
    except (LaunchConfigError, SshError) as exc:
        click.echo(f"dslaunch check: {exc}", err=True)
        sys.exit(2)
    python = opts.remote_python or sys.executable
    remote = [(h.ssh_target, h.slots) for h in hosts if h.ssh_target not in local]
    if launcher != "ssh":
        try:
            by_host = {r.host: r for r in tool_probe(launcher, remote, opts, python, master, master_port)}
        except LaunchConfigError as exc:
            click.echo(f"dslaunch check: {exc}", err=True)
            sys.exit(2)
    else:
        by_host = {r.host: r for r in run_preflight(remote, opts.ssh, python, master, master_port)}
    for h in hosts:
        if h.ssh_target in local:
            by_host[h.ssh_target] = local_probe(h.ssh_target, h.slots, sys.executable, master, master_port,
                                                opts.ssh_timeout)
    reports = [by_host[h.ssh_target] for h in hosts]
    click.echo(format_table(reports, f"{master}:{master_port}"))
    problem = summary_line(reports)
    if problem:
        click.echo(f"dslaunch check: {problem}", err=True)
        sys.exit(1)
