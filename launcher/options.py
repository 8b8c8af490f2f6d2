"""Every option of `dslaunch`, resolved, as one dataclass; validated here, not in the CLI.

LaunchOptions mirrors the command line one field per option (cli.py builds it with
LaunchOptions(**params)), so adding an option means a field here and a decorator there.
Validation is pure and complete before anything starts: a value that cannot be honoured
(nan seconds, a negative count, a port above 65535) is a LaunchConfigError naming the
option, never a spin, a traceback or a silently different launch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from dslaunch.launcher.errors import LaunchConfigError

# The rendezvous port when none is given: torchrun's and DeepSpeed's default, defined once.
DEFAULT_MASTER_PORT = 29500
# More worker slots than this on one host is a typo (a GPU server has 8-16; a CPU box a
# few hundred cores), and building that many workers would take minutes and gigabytes.
MAX_SLOTS = 1024
MAX_SECONDS = 24 * 3600  # bound for every duration option (grace, timeouts)
DEFAULT_HEARTBEAT_TIMEOUT = 20.0


@dataclass(frozen=True)
class SshOptions:
    """The `--ssh_*` options; None means "ask ~/.ssh/config, then the default"."""

    user: Optional[str] = None
    port: Optional[int] = None
    key: Optional[str] = None
    timeout: float = 10.0
    accept_new_host_keys: bool = False
    config_path: Optional[str] = None  # default ~/.ssh/config


def check_seconds(option: str, value: float, *, minimum: float = 0.0, allow_min: bool = True) -> None:
    """A duration option must be a finite number in [minimum, MAX_SECONDS]."""
    if not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise LaunchConfigError(f"{option} {value}: must be a finite number of seconds")
    if value < minimum or (value == minimum and not allow_min):
        bound = f"{minimum:g} or more" if allow_min else f"more than {minimum:g}"
        raise LaunchConfigError(f"{option} {value:g}: must be {bound}")
    if value > MAX_SECONDS:
        raise LaunchConfigError(f"{option} {value:g}: more than {MAX_SECONDS} s (24 hours) is surely a typo")


@dataclass
class LaunchOptions:
    """Every option of `dslaunch`, resolved (command line over DSLAUNCH_* over default)."""

    script: str
    script_args: Tuple[str, ...] = ()
    # layout
    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None
    hostfile: Optional[str] = None
    include: str = ""
    exclude: str = ""
    master_addr: Optional[str] = None
    master_port: Optional[int] = None  # None: DEFAULT_MASTER_PORT, or a free port if that is taken here (plan.py)
    # what each worker runs
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    env_file: Optional[str] = None
    bind_cores_to_rank: bool = False
    bind_core_list: Optional[str] = None
    # supervision and output
    log_dir: Optional[str] = None
    max_restarts: int = 0
    kill_grace: float = 5.0
    save_pid: bool = False
    dry_run: bool = False
    json: bool = False
    # other hosts
    launcher: str = "ssh"
    launcher_args: str = ""
    force_multi: bool = False
    ssh_user: Optional[str] = None
    ssh_port: Optional[int] = None
    ssh_key: Optional[str] = None
    ssh_timeout: float = 10.0
    accept_new_host_keys: bool = False
    remote_python: Optional[str] = None
    workdir: Optional[str] = None
    export: Tuple[str, ...] = ()
    show_env: bool = False
    skip_check: bool = False
    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT
    # elastic jobs (docs/elastic.md) and the runtime's own checkpoints
    min_nodes: Optional[int] = None
    max_nodes: Optional[int] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None

    def __post_init__(self):
        self.script_args = tuple(self.script_args)
        self.export = tuple(self.export)
        if self.max_restarts < 0:
            raise LaunchConfigError(f"--max_restarts {self.max_restarts}: must be 0 or more")
        check_seconds("--kill_grace", self.kill_grace)
        check_seconds("--ssh_timeout", self.ssh_timeout, allow_min=False)
        check_seconds("--heartbeat_timeout", self.heartbeat_timeout, minimum=1.0)
        if self.master_port is not None and not 0 <= self.master_port <= 65535:
            raise LaunchConfigError(f"--master_port {self.master_port}: not a TCP port (0 picks a free one)")
        if self.ssh_port is not None and not 0 < self.ssh_port < 65536:
            raise LaunchConfigError(f"--ssh_port {self.ssh_port}: not a TCP port")
        for name in ("num_gpus", "num_nodes"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_SLOTS:
                raise LaunchConfigError(f"--{name} {value}: must be between 1 and {MAX_SLOTS}")
        if self.json and not self.dry_run:
            raise LaunchConfigError("--json only applies to --dry_run")
        if self.module and self.no_python:
            raise LaunchConfigError("--module and --no_python cannot be used together")
        if self.bind_core_list is not None and not self.bind_cores_to_rank:
            raise LaunchConfigError("--bind_core_list needs --bind_cores_to_rank")
        if self.checkpoint_every is not None:
            if self.checkpoint_dir is None:
                raise LaunchConfigError(f"--checkpoint_every {self.checkpoint_every} needs --checkpoint_dir (where to save)")
            if self.checkpoint_every < 1:
                raise LaunchConfigError(f"--checkpoint_every {self.checkpoint_every}: must be 1 or more steps")
        if self.checkpoint_dir is not None and not self.checkpoint_dir.strip():
            raise LaunchConfigError("--checkpoint_dir: empty path")
        if self.elastic and not self.hostfile:
            which = "--min_nodes" if self.min_nodes is not None else "--max_nodes"
            raise LaunchConfigError(f"{which}: an elastic job needs a --hostfile listing its hosts")
        if self.elastic and self.launcher != "ssh":
            raise LaunchConfigError(f"--min_nodes/--max_nodes: elastic jobs run with --launcher ssh (dslaunch's own "
                                    f"node agents re-plan the hosts), not --launcher {self.launcher}")

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None or self.max_nodes is not None

    @property
    def ssh(self) -> SshOptions:
        return SshOptions(user=self.ssh_user, port=self.ssh_port, key=self.ssh_key, timeout=self.ssh_timeout,
                          accept_new_host_keys=self.accept_new_host_keys)
