"""`--launcher slurm`: srun starts every rank inside an allocation; dslaunch builds its command.

    srun -N NODES -n WORLD --ntasks-per-node=K -w host1,host2 --export=ALL --kill-on-bad-exit=1
         --chdir=DIR PYTHON -m dslaunch.launcher.cluster_env -- WORKER ARGV

srun copies the environment it runs in (`--export=ALL`), so values stay off its command
line. Slurm places the same number of tasks on every node: a layout with uneven slots is
refused before anything starts.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from dslaunch.launcher.backends import ToolBackend, rank_shim, split_args
from dslaunch.launcher.errors import LaunchConfigError


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


class SlurmBackend(ToolBackend):
    name = "slurm"
    summary = "srun starts the ranks inside a Slurm allocation; SLURM_* mapped to the contract"
    exe, package = "srun", "slurm-client"
    command = staticmethod(command)


BACKEND = SlurmBackend()
