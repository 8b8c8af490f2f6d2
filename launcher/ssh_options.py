"""The multi-node options of `dslaunch` and their dataclasses; import-light on purpose.

cli.py imports this module on every launch, so it needs click only: paramiko (hundreds
of milliseconds to import) is loaded by ssh.py only when a job really spans hosts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import click

from dslaunch.launcher.errors import LaunchConfigError

LAUNCHERS = ("ssh", "pdsh", "openmpi", "slurm")


@dataclass(frozen=True)
class SshOptions:
    """The `--ssh_*` options; None means "ask ~/.ssh/config, then the default"."""
    user: Optional[str] = None
    port: Optional[int] = None
    key: Optional[str] = None
    timeout: float = 10.0
    accept_new_host_keys: bool = False
    config_path: Optional[str] = None  # default ~/.ssh/config


@dataclass(frozen=True)
class MultiNodeOptions:
    ssh: SshOptions = field(default_factory=SshOptions)
    launcher: str = "ssh"
    launcher_args: str = ""
    remote_python: Optional[str] = None
    workdir: Optional[str] = None
    exports: Tuple[str, ...] = ()
    show_env: bool = False
    skip_check: bool = False

    def __post_init__(self):
        if self.ssh.timeout <= 0:
            raise LaunchConfigError(f"--ssh_timeout {self.ssh.timeout}: must be more than 0")
        if self.ssh.port is not None and not 0 < self.ssh.port < 65536:
            raise LaunchConfigError(f"--ssh_port {self.ssh.port}: not a TCP port")


_OPTIONS = [
    click.option("--launcher", type=click.Choice(LAUNCHERS), default="ssh", show_default=True, show_envvar=True,
                 help="How to start work on other hosts: ssh (paramiko, built in), pdsh, openmpi (mpirun), slurm (srun)."),
    click.option("--launcher_args", default="", show_envvar=True,
                 help="Extra arguments for pdsh/mpirun/srun, split like a shell would."),
    click.option("--ssh_user", default=None, show_envvar=True,
                 help="Remote user (default: user@ in the hostfile, then ~/.ssh/config, then you)."),
    click.option("--ssh_port", type=int, default=None, show_envvar=True, help="SSH port (default: ~/.ssh/config, then 22)."),
    click.option("--ssh_key", default=None, show_envvar=True, help="Private key file (default: ~/.ssh/config, then ssh's defaults)."),
    click.option("--ssh_timeout", type=float, default=10.0, show_default=True, show_envvar=True,
                 help="Seconds to connect to a host before giving up on it."),
    click.option("--accept_new_host_keys", is_flag=True, default=False, show_envvar=True,
                 help="Trust and record host keys missing from known_hosts (a changed key is always refused)."),
    click.option("--remote_python", default=None, show_envvar=True,
                 help="Interpreter on the other hosts (default: this interpreter's path)."),
    click.option("--workdir", default=None, show_envvar=True,
                 help="Working directory on the other hosts (default: the current one)."),
    click.option("--export", "export", multiple=True, show_envvar=True,
                 help="NAME or NAME=VALUE: also send this variable to remote workers (repeatable)."),
    click.option("--show_env", is_flag=True, default=False, show_envvar=True,
                 help="Print forwarded variables' values instead of ***."),
    click.option("--skip_check", is_flag=True, default=False, show_envvar=True,
                 help="Skip the preflight check before a multi-node launch."),
]
_NAMES = ("launcher", "launcher_args", "ssh_user", "ssh_port", "ssh_key", "ssh_timeout", "accept_new_host_keys",
          "remote_python", "workdir", "export", "show_env", "skip_check")


def multinode_options(f):
    """Decorator adding the multi-node options to a click command."""
    for opt in reversed(_OPTIONS):
        f = opt(f)
    return f


def pop_multinode_options(params: dict) -> MultiNodeOptions:
    """Take the multi-node options out of a click params dict (the rest is LaunchOptions')."""
    p = {name: params.pop(name) for name in _NAMES if name in params}
    ssh = SshOptions(user=p.get("ssh_user"), port=p.get("ssh_port"), key=p.get("ssh_key"),
                     timeout=p.get("ssh_timeout", 10.0), accept_new_host_keys=p.get("accept_new_host_keys", False))
    return MultiNodeOptions(ssh=ssh, launcher=p.get("launcher", "ssh"), launcher_args=p.get("launcher_args", ""),
                            remote_python=p.get("remote_python"), workdir=p.get("workdir"),
                            exports=tuple(p.get("export", ())), show_env=p.get("show_env", False),
                            skip_check=p.get("skip_check", False))
