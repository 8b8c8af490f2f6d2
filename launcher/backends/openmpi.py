"""`--launcher openmpi`: mpirun starts every rank; dslaunch builds and runs its command.

    mpirun -n WORLD -H host1:2,host2:2 --wdir DIR --map-by slot --bind-to none
           --mca plm_rsh_agent ssh --mca plm_rsh_args "SSH ARGS" [--allow-run-as-root] -x NAME...
           PYTHON -m dslaunch.launcher.cluster_env --node_sizes 2,2 --whole_lines -- WORKER ARGV

Values of the shared environment never appear on mpirun's command line: `-x NAME` copies
each from the environment mpirun itself runs in. mpirun reaches the hosts with the system
ssh, given the arguments that make it see what dslaunch's own SSH sees (the --ssh_*
options, and $HOME's ~/.ssh where that is not the passwd home). As root, mpirun refuses to
start without --allow-run-as-root; dslaunch runs as root only when the user does, so it
passes the flag then. mpirun supervises the ranks (it stops the job when one fails and
exits with that rank's code); heartbeats do not apply.

Open MPI numbers ranks but not nodes (OMPI_COMM_WORLD_NODE_RANK is a rank among the
processes of one node, not the node's index), so the shim gets the slots per node, in
-H order, which `--map-by slot` fills in turn, and derives NODE_RANK from the rank.
"""
from __future__ import annotations

import os
from typing import Dict, List, Mapping, Optional, Tuple

from dslaunch.launcher.backends import ToolBackend, rank_shim, split_args, system_ssh_args
from dslaunch.launcher.errors import LaunchConfigError

ROOT_FLAG = "--allow-run-as-root"


def _base(n: int, hosts: str, ssh_opts, environ: Mapping[str, str], euid: int, passwd_home: Optional[str],
          extra: List[str]) -> List[str]:
    rsh = system_ssh_args(ssh_opts, environ, passwd_home)
    spaced = [a for a in rsh if any(c.isspace() for c in a)]
    if spaced:  # mpirun splits plm_rsh_args at whitespace, with no quoting
        raise LaunchConfigError(f"--launcher openmpi: mpirun cannot pass an ssh argument containing a space: {spaced[0]!r}")
    argv = ["mpirun", "-n", str(n), "-H", hosts, "--map-by", "slot", "--bind-to", "none",
            "--mca", "plm_rsh_agent", "ssh", "--mca", "plm_rsh_args", " ".join(rsh)]
    if euid == 0 and ROOT_FLAG not in extra:
        argv.append(ROOT_FLAG)
    return argv


def command(plan, environ: Optional[Mapping[str, str]] = None, euid: Optional[int] = None,
            passwd_home: Optional[str] = None) -> Tuple[List[str], Dict[str, str]]:
    environ = os.environ if environ is None else environ
    euid = os.geteuid() if euid is None else euid
    shim, env = rank_shim(plan, node_sizes=[n.node.local_world_size for n in plan.nodes], whole_lines=True)
    extra = split_args(plan.options.launcher_args)
    argv = _base(plan.world.world_size, ",".join(f"{n.target}:{n.node.local_world_size}" for n in plan.nodes),
                 plan.options.ssh, environ, euid, passwd_home, extra)
    argv += ["--wdir", plan.workdir]
    for name in sorted(env):
        argv += ["-x", name]
    return argv + extra + shim, env


class OpenMpiBackend(ToolBackend):
    name = "openmpi"
    summary = "mpirun starts the ranks (OpenMPI); dslaunch maps OMPI_COMM_WORLD_* to the contract"
    exe, package = "mpirun", "openmpi-bin"
    command = staticmethod(command)

    def probe_command(self, hosts: List[str], opts, environ: Mapping[str, str]) -> Tuple[List[str], Dict[str, str]]:
        """`dslaunch check --launcher openmpi`: one probe per host, started by mpirun as a job is."""
        self.require()
        extra = split_args(opts.launcher_args)
        argv = _base(len(hosts), ",".join(f"{h}:1" for h in hosts), opts.ssh, environ, os.geteuid(), None, extra)
        return argv + ["-x", "DSLAUNCH_PROBE_ARGS"] + extra, {}

    def probe_host_index(self, info: dict, hosts: List[str]) -> int:
        return int(info["task"])  # one rank per host, in -H order


BACKEND = OpenMpiBackend()
