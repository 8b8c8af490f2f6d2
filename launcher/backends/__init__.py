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
import math
import os
import pkgutil
import shlex
import shutil
import signal
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Tuple

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


def rank_shim(plan, node_sizes: Optional[List[int]] = None,
              whole_lines: bool = False) -> "tuple[List[str], Dict[str, str]]":
    """For tools that start every rank themselves (mpirun, srun): the one command all ranks
    run and the environment they share, both taken from the plan.

    Each rank runs `python -m dslaunch.launcher.cluster_env [--local_rank_at I] -- ARGV`,
    which maps the tool's rank variables to the contract (RANK, LOCAL_RANK, ...) and, where
    the plan had `--local_rank=N`, inserts this rank's value at the same place; with
    `node_sizes` (ranks per node, in rank order) it derives NODE_RANK from the rank. The shared
    environment is every variable the plan gives all workers alike; the per-rank ones come
    from the shim. `whole_lines` makes the shim pass the worker's output on in whole lines
    (for a tool that forwards it in the chunks written).
    """
    workers = [w for node in plan.nodes for w in node.workers]
    first = workers[0]
    argv = list(first.argv)
    shim = [plan.remote_python, "-m", "dslaunch.launcher.cluster_env"]
    if node_sizes is not None:
        shim += ["--node_sizes", ",".join(str(n) for n in node_sizes)]
    if whole_lines:
        shim.append("--whole_lines")
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


def system_ssh_args(opts, environ: Mapping[str, str], passwd_home: Optional[str] = None) -> List[str]:
    """Arguments for the system `ssh` a tool runs (mpirun's rsh agent), so that it reaches the
    hosts as dslaunch's own SSH (paramiko) does: the --ssh_* options, batch mode, and, where
    $HOME is not the passwd entry's home (OpenSSH reads only the latter), $HOME's
    ~/.ssh/config and known_hosts, which are the ones dslaunch and `dslaunch check` read.
    """
    args: List[str] = []
    home = environ.get("HOME")
    if passwd_home is None:
        import pwd

        try:
            passwd_home = pwd.getpwuid(os.getuid()).pw_dir
        except KeyError:
            passwd_home = home
    if home and os.path.realpath(home) != os.path.realpath(passwd_home or home):
        config = opts.config_path or os.path.join(home, ".ssh", "config")
        if os.path.isfile(config):
            args += ["-F", config]
        args += ["-o", f"UserKnownHostsFile={os.path.join(home, '.ssh', 'known_hosts')}"]
    elif opts.config_path:
        args += ["-F", opts.config_path]
    if opts.key:
        args += ["-i", opts.key]
    if opts.port:
        args += ["-p", str(opts.port)]
    if opts.user:
        args += ["-l", opts.user]
    args += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(max(1, math.ceil(opts.timeout)))}"]
    if opts.accept_new_host_keys:
        args += ["-o", "StrictHostKeyChecking=accept-new"]
    return args


# A signal to dslaunch stops the tool with SIGTERM: srun takes only that as "cancel the step"
# (its first SIGINT merely prints the tasks' states), and mpirun ends the job on it as well.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run_tool(argv: List[str], env: Dict[str, str], plan, output,
             first_failure: Optional[Callable[[str], Optional[Tuple[str, int]]]] = None, err_fd=None) -> int:
    """Run mpirun/srun in the foreground with the shared env; the job's exit code.

    The tool runs in its own session, so a Ctrl-C reaches dslaunch alone, which stops the
    tool with SIGTERM and waits for it to take its ranks down; the tool also gets SIGTERM from
    the kernel when dslaunch dies, even by SIGKILL (PR_SET_PDEATHSIG). `first_failure`, given
    one line of the tool's stderr, returns ("host:rank", exit code) when the line reports a
    rank's failure: the first such line decides the job's exit code, since the tool's own
    code can be the signal it used on the other ranks.
    """
    import subprocess
    import threading

    from dslaunch.launcher.reaper import make_child_setup

    shown = shown_command(argv, env, plan)
    output.say("running " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(shown["env"].items()))
               + " " + shlex.join(argv))
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE if first_failure else None, start_new_session=True,
                            preexec_fn=make_child_setup(signal.SIGTERM))
    failures: List[Tuple[str, int]] = []
    reader = None
    if first_failure is not None:
        def relay() -> None:
            for raw in proc.stderr:
                _write(err_fd, raw)
                found = first_failure(raw.decode("utf-8", "replace").rstrip("\n"))
                if found is not None:
                    failures.append(found)
        reader = threading.Thread(target=relay, daemon=True, name="dslaunch-tool-stderr")
        reader.start()
    got: List[int] = []

    def forward(signum, frame) -> None:
        got.append(signum)
        try:
            proc.send_signal(signal.SIGTERM if len(got) == 1 else signal.SIGKILL)
        except ProcessLookupError:
            pass

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        code = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if reader is not None:
        reader.join()
    if got:
        output.say(f"stopped {shlex.quote(argv[0])} on {signal.Signals(got[0]).name}")
        return 128 + got[0]
    if code != 0 and failures:
        where, first = failures[0]
        output.say(f"{where} failed first: exited with code {first}" if first < 128 else
                   f"{where} failed first: killed by {_signal_name(first - 128)}")
        return first
    return code if code >= 0 else 128 - code


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _write(fd, data: bytes) -> None:
    import sys

    try:
        if fd is None:
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()
        else:
            os.write(fd, data)
    except OSError:
        pass


class ToolBackend:
    """A backend whose tool starts every rank itself (mpirun, srun): everything follows from
    command(plan) -> (argv, shared env)."""

    name = summary = exe = package = ""

    def command(self, plan) -> "tuple[List[str], Dict[str, str]]":
        raise NotImplementedError

    def require(self) -> str:
        return require_tool(self.exe, self.package, self.name)

    def check(self, plan) -> None:
        o = plan.options
        # the tool supervises and writes the ranks' output itself: these would be silently ignored
        if o.max_restarts:
            raise LaunchConfigError(f"--max_restarts is not supported with --launcher {self.name} "
                                    f"({self.exe} stops the job at the first failure)")
        if o.log_dir:
            raise LaunchConfigError(f"--log_dir is not supported with --launcher {self.name}; "
                                    f"pass {self.exe}'s own output options through --launcher_args")
        self.command(plan)
        self.require()

    def describe(self, plan) -> Dict[str, Any]:
        return shown_command(*self.command(plan), plan)

    def run(self, plan, output, err_fd) -> int:
        return run_tool(*self.command(plan), plan, output)
