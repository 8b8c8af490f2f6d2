"""`--launcher slurm`: srun starts every rank inside an allocation; dslaunch builds its command.

    srun -N NODES -n WORLD --ntasks-per-node=K -w host1,host2 --export=ALL --kill-on-bad-exit=1
         --chdir=DIR PYTHON -m dslaunch.launcher.cluster_env -- WORKER ARGV

The hosts are the hostfile's, or, with no --hostfile inside `salloc`/`sbatch`, the
allocation's nodes (allocation.py). srun copies the environment it runs in
(`--export=ALL`), so values stay off its command line. Slurm places the same number of
tasks on every node: a layout with uneven slots is refused before anything starts.

srun's own exit code is the highest of its tasks', which after --kill-on-bad-exit is the
SIGTERM it sent the others (143), not the failing rank's. The first `srun: error: HOST:
task N: Exited with exit code C` (or `...: Killed`, a signal's name) on its stderr names the
rank that failed first; that rank's code is the job's, as with the other backends.
"""
from __future__ import annotations

import re
import signal
from typing import Dict, List, Optional, Tuple

from dslaunch.launcher.backends import ToolBackend, rank_shim, run_tool, split_args
from dslaunch.launcher.errors import LaunchConfigError

_TASK_LINE = re.compile(r"^srun: error: (\S+): tasks? (\d+)[-,\d]*: (.+)$")
_EXITED = re.compile(r"^Exited with exit code (\d+)$")


def command(plan) -> Tuple[List[str], Dict[str, str]]:
    counts = {n.node.local_world_size for n in plan.nodes}
    if len(counts) != 1:
        raise LaunchConfigError("--launcher slurm needs the same number of processes on every node (got "
                                + ", ".join(f"{n.node.host}={n.node.local_world_size}" for n in plan.nodes) + ")")
    shim, env = rank_shim(plan)
    argv = ["srun", "-N", str(len(plan.nodes)), "-n", str(plan.world.world_size),
            f"--ntasks-per-node={counts.pop()}", "-w", ",".join(n.node.host for n in plan.nodes),
            "--export=ALL", "--kill-on-bad-exit=1", f"--chdir={plan.workdir}"]
    return argv + split_args(plan.options.launcher_args) + shim, env


def _signal_by_description() -> Dict[str, int]:
    out = {}
    for sig in signal.Signals:
        text = signal.strsignal(sig)
        if text:
            out[text] = int(sig)
    return out


def task_failure(line: str) -> Optional[Tuple[str, int]]:
    """("host:rank", exit code) from srun's report of a task's end, else None; a task
    killed by a signal counts as 128 + its number, as a shell would say."""
    m = _TASK_LINE.match(line.strip())
    if m is None:
        return None
    host, rank, what = m.groups()
    exited = _EXITED.match(what)
    if exited:
        code = int(exited.group(1))
        return (f"{host}:{rank}", code) if code else None
    signum = _signal_by_description().get(what.split(" (core dumped)")[0])
    return (f"{host}:{rank}", 128 + signum) if signum else None


class SlurmBackend(ToolBackend):
    name = "slurm"
    summary = "srun starts the ranks inside a Slurm allocation; SLURM_* mapped to the contract"
    exe, package = "srun", "slurm-client"
    command = staticmethod(command)

    def probe_command(self, hosts: List[str], opts, environ) -> Tuple[List[str], Dict[str, str]]:
        """`dslaunch check --launcher slurm`: one probe per node, started by srun as a job is."""
        self.require()
        return ["srun", "-N", str(len(hosts)), "-n", str(len(hosts)), "--ntasks-per-node=1", "-w", ",".join(hosts),
                "--export=ALL", *split_args(opts.launcher_args)], {}

    def probe_host_index(self, info: dict, hosts: List[str]) -> int:
        # srun orders nodes its own way: a node is known by its name, which Slurm takes from the hostname
        short = str(info["host"]).split(".")[0]
        names = [h.split(".")[0] for h in hosts]
        return names.index(short) if short in names else -1

    def run(self, plan, output, err_fd) -> int:
        return run_tool(*self.command(plan), plan, output, first_failure=task_failure, err_fd=err_fd)


BACKEND = SlurmBackend()
