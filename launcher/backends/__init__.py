"""Backends: how a plan's nodes on other hosts are started. One module per backend.

Every module of this package whose name does not start with `_` is a backend, and its
name is a `--launcher` choice: adding a backend is adding one file that defines
`BACKEND`, an object with

    name, summary                       the --launcher value and one line for --help
    check(plan) -> None                 refuse (LaunchConfigError) before anything starts:
                                        a missing tool, a bad --launcher_args
    describe(plan) -> dict              what --dry_run adds to the plan: the command each
                                        host runs, with values masked (masking.py)
    run(plan, output, err_fd) -> int    run every attempt; the job's exit code

Modules are imported only when used and must stay import-light at module level (the CLI
lists them on every launch): paramiko and friends are imported inside their functions.
"""
from __future__ import annotations

import importlib
import pkgutil
import shlex
import shutil
from typing import Any, Callable, Dict, List, Protocol

from dslaunch.launcher.errors import LaunchConfigError

DEFAULT = "ssh"


class Backend(Protocol):
    name: str
    summary: str

    def check(self, plan) -> None: ...

    def describe(self, plan) -> Dict[str, Any]: ...

    def run(self, plan, output, err_fd) -> int: ...


def names() -> List[str]:
    """Every backend, the default first."""
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return sorted(found, key=lambda n: n != DEFAULT)


def get(name: str) -> Backend:
    if name not in names():
        raise LaunchConfigError(f"--launcher {name}: unknown (choose from {', '.join(names())})")
    return importlib.import_module(f"{__name__}.{name}").BACKEND


def require_tool(exe: str, package: str, launcher: str, which: Callable = shutil.which) -> str:
    """Path of a backend's tool, or a LaunchConfigError naming the package to install."""
    path = which(exe)
    if not path:
        raise LaunchConfigError(f"--launcher {launcher} needs `{exe}`, which is not on PATH "
                                f"(Debian/Ubuntu: apt-get install {package})")
    return path


def split_args(text: str) -> List[str]:
    """--launcher_args, split like a shell would."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise LaunchConfigError(f"--launcher_args {text!r}: {exc}") from None


def agent_command(python: str, workdir: str) -> str:
    """The only shell line that reaches a remote host: both words quoted."""
    return f"cd {shlex.quote(workdir)} && exec {shlex.quote(python)} -u -m dslaunch.launcher.agent"


def rank_shim(plan) -> "tuple[List[str], Dict[str, str]]":
    """For tools that start every rank themselves (mpirun, srun): the one command all ranks
    run and the environment they share, both taken from the plan.

    Each rank runs `python -m dslaunch.launcher.cluster_env [--local_rank_at I] -- ARGV`,
    which maps the tool's rank variables to the contract (RANK, LOCAL_RANK, ...) and, where
    the plan had `--local_rank=N`, inserts this rank's value at the same place. The shared
    environment is every variable the plan gives all workers alike; the per-rank ones come
    from the shim.
    """
    workers = [w for node in plan.nodes for w in node.workers]
    first = workers[0]
    argv = list(first.argv)
    shim = [plan.remote_python, "-m", "dslaunch.launcher.cluster_env"]
    marker = f"--local_rank={first.local_rank}"
    if not plan.options.no_local_rank and marker in argv:
        at = argv.index(marker)
        del argv[at]
        shim += ["--local_rank_at", str(at)]
    env = {k: v for k, v in first.env.items() if all(w.env.get(k) == v for w in workers)}
    return [*shim, "--", *argv], env


def shown_command(argv: List[str], env: Dict[str, str], plan) -> Dict[str, Any]:
    """A tool's command as --dry_run and the launch itself print it, values masked."""
    from dslaunch.launcher.masking import masked

    return {"command": list(argv), "env": masked(env, plan.hidden, plan.options.show_env)}


def run_tool(argv: List[str], env: Dict[str, str], plan, output) -> int:
    """Run mpirun/srun in the foreground with the shared env; its exit code is the job's."""
    import os
    import subprocess

    shown = shown_command(argv, env, plan)
    output.say("running " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(shown["env"].items()))
               + " " + shlex.join(argv))
    proc = subprocess.run(argv, env={**os.environ, **env})
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


class ToolBackend:
    """A backend whose tool starts every rank itself (mpirun, srun): everything follows from
    command(plan) -> (argv, shared env)."""

    name = summary = exe = package = ""

    def command(self, plan) -> "tuple[List[str], Dict[str, str]]":
        raise NotImplementedError

    def check(self, plan) -> None:
        self.command(plan)
        require_tool(self.exe, self.package, self.name)

    def describe(self, plan) -> Dict[str, Any]:
        return shown_command(*self.command(plan), plan)

    def run(self, plan, output, err_fd) -> int:
        return run_tool(*self.command(plan), plan, output)
