"""Commands for the cluster launchers other than our own SSH transport: pdsh, OpenMPI, Slurm.

Pure functions: a `ClusterJob` in, a `ClusterCommand` (argv + the environment to run it
with) out, so every generator is unit-tested without the tools installed.

How each tool gets the per-worker contract (RANK, LOCAL_RANK, WORLD_SIZE, ...):
- pdsh starts one node agent per host, which then behaves as under `--launcher ssh`; pdsh
  substitutes its node index for `%n`, which selects the agent's node in the plan. pdsh
  hands the remote shell a string, so every word is quoted with shlex.quote, which POSIX
  sh undoes exactly.
- mpirun and srun start every rank themselves; each rank runs through
  `python -m dslaunch.launcher.cluster_env`, which maps OMPI_COMM_WORLD_* / SLURM_* to the
  contract and then execs the script. Values of exported variables never appear on their
  command lines: mpirun `-x NAME` and srun `--export=ALL` copy them from the environment
  the tool itself runs in.
"""
from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

LAUNCHERS = ("ssh", "pdsh", "openmpi", "slurm")

# tool -> (executable, Debian package that provides it)
TOOLS = {
    "pdsh": ("pdsh", "pdsh"),
    "openmpi": ("mpirun", "openmpi-bin"),
    "slurm": ("srun", "slurm-client"),
}


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True)
class ClusterJob:
    hosts: Sequence[Tuple[str, int]]       # (hostfile entry, slots used) in node-rank order
    worker_argv: Sequence[str]             # what every rank runs: [python, -u, script, args...]
    env: Dict[str, str] = field(default_factory=dict)  # extra variables for every rank
    master_addr: str = ""
    master_port: int = 29500
    workdir: Optional[str] = None
    python: str = "python3"
    launcher_args: str = ""                # --launcher_args, split like a shell would
    local_rank_at: Optional[int] = None    # insert --local_rank=N at this argv index (known only per rank)

    @property
    def world_size(self) -> int:
        return sum(slots for _, slots in self.hosts)


@dataclass(frozen=True)
class ClusterCommand:
    argv: List[str]
    env: Dict[str, str]        # to add to the tool's own environment


def require_tool(launcher: str, which=shutil.which) -> str:
    """Path of the tool behind `launcher`, or a ClusterError naming the package to install."""
    exe, package = TOOLS[launcher]
    path = which(exe)
    if not path:
        raise ClusterError(
            f"--launcher {launcher} needs `{exe}`, which is not on PATH "
            f"(Debian/Ubuntu: apt-get install {package})"
        )
    return path


def _extra(job: ClusterJob) -> List[str]:
    try:
        return shlex.split(job.launcher_args)
    except ValueError as exc:
        raise ClusterError(f"--launcher_args: {exc}") from None


def _rank_shim(job: ClusterJob) -> List[str]:
    shim = [job.python, "-m", "dslaunch.launcher.cluster_env"]
    if job.local_rank_at is not None:
        shim += ["--local_rank_at", str(job.local_rank_at)]
    return [*shim, "--", *job.worker_argv]


def _contract_env(job: ClusterJob) -> Dict[str, str]:
    env = dict(job.env)
    env["MASTER_ADDR"] = job.master_addr
    env["MASTER_PORT"] = str(job.master_port)
    return env


def pdsh_command(job: ClusterJob, agent_argv: Sequence[str]) -> ClusterCommand:
    """pdsh -w host1,host2 '<cd workdir &&> <agent argv> --node_rank %n'.

    `agent_argv` already carries the plan (see multinode); pdsh replaces %n per host.
    """
    names = []
    for host, _ in job.hosts:
        if "," in host:
            raise ClusterError(f"pdsh: host name {host!r} contains a comma")
        names.append(host)
    # pdsh substitutes %h/%u/%n everywhere in the command, so a literal % must be doubled
    def q(word: str) -> str:
        return shlex.quote(word).replace("%", "%%")

    remote = " ".join(q(a) for a in agent_argv) + " --node_rank %n"
    if job.workdir:
        remote = f"cd {q(job.workdir)} && exec {remote}"
    argv = ["pdsh", "-S", "-R", "ssh", "-f", str(len(names)), "-w", ",".join(names), *_extra(job), remote]
    return ClusterCommand(argv=argv, env={})


def openmpi_command(job: ClusterJob, hostfile_path: Optional[str] = None) -> ClusterCommand:
    """mpirun -n WORLD (--hostfile F | -H h1:2,h2:2) -x VAR ... shim worker_argv."""
    env = _contract_env(job)
    argv = ["mpirun", "-n", str(job.world_size)]
    if hostfile_path:
        argv += ["--hostfile", hostfile_path]
    else:
        argv += ["-H", ",".join(f"{host}:{slots}" for host, slots in job.hosts)]
    if job.workdir:
        argv += ["--wdir", job.workdir]
    argv += ["--map-by", "slot", "--bind-to", "none"]
    for name in sorted(env):
        argv += ["-x", name]
    argv += _extra(job)
    argv += _rank_shim(job)
    return ClusterCommand(argv=argv, env=env)


def slurm_command(job: ClusterJob) -> ClusterCommand:
    """srun -N nodes -n WORLD --ntasks-per-node ... -w hosts --export=ALL shim worker_argv."""
    slots = {s for _, s in job.hosts}
    if len(slots) != 1:
        raise ClusterError(
            "--launcher slurm needs the same number of processes on every node "
            f"(got {', '.join(f'{h}={s}' for h, s in job.hosts)})"
        )
    env = _contract_env(job)
    argv = [
        "srun", "-N", str(len(job.hosts)), "-n", str(job.world_size),
        f"--ntasks-per-node={slots.pop()}", "-w", ",".join(h.rpartition("@")[2] for h, _ in job.hosts),
        "--export=ALL", "--kill-on-bad-exit=1",
    ]
    if job.workdir:
        argv += [f"--chdir={job.workdir}"]
    argv += _extra(job)
    argv += _rank_shim(job)
    return ClusterCommand(argv=argv, env=env)
