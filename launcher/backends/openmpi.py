"""`--launcher openmpi`: mpirun starts every rank; dslaunch builds and runs its command.

    mpirun -n WORLD -H host1:2,host2:2 --wdir DIR --map-by slot --bind-to none -x NAME...
           PYTHON -m dslaunch.launcher.cluster_env -- WORKER ARGV

Values of the shared environment never appear on mpirun's command line: `-x NAME` copies
each from the environment mpirun itself runs in. mpirun supervises the ranks (it stops the
job when one fails); heartbeats do not apply.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from dslaunch.launcher.backends import ToolBackend, rank_shim, split_args


def command(plan) -> Tuple[List[str], Dict[str, str]]:
    shim, env = rank_shim(plan)
    argv = ["mpirun", "-n", str(plan.world.world_size),
            "-H", ",".join(f"{n.target}:{n.node.local_world_size}" for n in plan.nodes),
            "--wdir", plan.workdir, "--map-by", "slot", "--bind-to", "none"]
    for name in sorted(env):
        argv += ["-x", name]
    return argv + split_args(plan.options.launcher_args) + shim, env


class OpenMpiBackend(ToolBackend):
    name = "openmpi"
    summary = "mpirun starts the ranks (OpenMPI); dslaunch maps OMPI_COMM_WORLD_* to the contract"
    exe, package = "mpirun", "openmpi-bin"
    command = staticmethod(command)


BACKEND = OpenMpiBackend()
