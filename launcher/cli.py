"""The `dslaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...` command.

Options stop at SCRIPT: everything after it reaches the workers untouched, even words
that look like our options (click: allow_interspersed_args=False + UNPROCESSED args).

Every option also reads DSLAUNCH_<OPTION> from the environment (click's
auto_envvar_prefix, so options added later get a variable without further code), and
--help shows each variable. To add an option: one `option(...)` below and a field of
the same name in options.LaunchOptions. Do not name an option after a variable the
workers receive (run_id, restart_count, accelerator, group_id): DSLAUNCH_RUN_ID and
friends are in every worker's environment, so a nested dslaunch would read them.

DeepSpeed's and torchrun's spellings are accepted where they mean the same (-H -i -e,
--num_accelerators, --nproc_per_node, --enable_each_rank_log, --no_ssh_check,
--master-port, ...); where the meaning differs, the option is refused with a hint saying
what to do instead (REFUSED, HINTS). Usage errors print one line and exit 2.
"""
from __future__ import annotations

import sys

import click

from dslaunch.launcher import backends
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.options import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_MASTER_PORT

ENV_PREFIX = "DSLAUNCH"

EXAMPLES = [
    ("dslaunch --num_gpus 2 train.py --epochs 3", "2 workers on this machine"),
    ("dslaunch -H hosts -i worker-0@worker-1:0,2 train.py", "some slots of two hosts, over SSH"),
    ("dslaunch --num_gpus 4 --dry_run --json train.py", "show the plan (env values masked), run nothing"),
]

# torchrun options whose meaning differs from ours: refused with what to use instead
HINTS = {
    "--node_rank": "node ranks follow the hostfile order: run dslaunch once, on one machine, with --hostfile",
    "--node-rank": "node ranks follow the hostfile order: run dslaunch once, on one machine, with --hostfile",
    "--rdzv-endpoint": "use --master_addr / --master_port",
    "--rdzv_endpoint": "use --master_addr / --master_port",
    "--rdzv-backend": "dslaunch rendezvous is MASTER_ADDR:MASTER_PORT (torch's env:// init); drop the option",
    "--rdzv_backend": "dslaunch rendezvous is MASTER_ADDR:MASTER_PORT (torch's env:// init); drop the option",
}

# DeepSpeed options dslaunch refuses rather than accept and ignore: param name -> why
REFUSED = {
    "no_ssh": "--no_ssh: dslaunch starts the other nodes itself; to run one node's workers without SSH, "
              "use a hostfile naming only this machine",
}


def option(*decls, **kwargs):
    """click.option whose help always names its DSLAUNCH_* variable."""
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


def ssh_options(f):
    """The SSH options, shared by the launch and `dslaunch check` (same names, same variables)."""
    for decorator in reversed([
        option("--ssh_user", default=None, help="Remote user (default: user@ in the hostfile, then ~/.ssh/config, then you)."),
        option("--ssh_port", type=int, default=None, help="SSH port (default: ~/.ssh/config, then 22)."),
        option("--ssh_key", default=None, help="Private key file (default: ~/.ssh/config, then ssh's defaults)."),
        option("--ssh_timeout", type=float, default=10.0, show_default=True,
               help="Seconds to connect to a host before giving up on it."),
        option("--accept_new_host_keys", is_flag=True, default=False,
               help="Trust and record host keys missing from known_hosts (a changed key is always refused)."),
        option("--remote_python", default=None, help="Interpreter on the other hosts (default: this interpreter's path)."),
    ]):
        f = decorator(f)
    return f


def _epilog() -> str:
    from dslaunch.launcher.main import SUBCOMMANDS

    width = max(len(w) for w in SUBCOMMANDS)
    lines = ["\b", "Subcommands (dslaunch SUBCOMMAND --help):"]
    lines += [f"  {word.ljust(width)}  {text}" for word, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "\b", "Examples:"]
    lines += [f"  {cmd}\n      {what}" for cmd, what in EXAMPLES]
    return "\n".join(lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dslaunch")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _show_version(ctx, _param, value):
    if value and not ctx.resilient_parsing:
        click.echo(f"dslaunch {_version()}")
        ctx.exit(0)


def _from_environment(ctx, param) -> str:
    """The DSLAUNCH_* variable `param` got its value from, or "" (the command line, a default):
    an error in a value nobody typed must say where it came from."""
    if ctx is None or param is None or param.name is None:
        return ""
    if ctx.get_parameter_source(param.name) is not click.core.ParameterSource.ENVIRONMENT:
        return ""
    if isinstance(param.envvar, str):
        return param.envvar
    return f"{ENV_PREFIX}_{param.name.upper()}"


def _with_variable(message: str) -> str:
    """A LaunchConfigError about an option ("--kill_grace -1: ...") whose value came from the
    environment names the variable too."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return message
    for param in ctx.command.params:
        var = _from_environment(ctx, param)
        if var and any(message.startswith(f"{o} ") or message.startswith(f"{o}:") for o in param.opts):
            return f"{var} in the environment: {message}"
    return message


class _LaunchCommand(click.Command):
    def main(self, args=None, prog_name=None, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            sys.exit(130)
        except click.NoSuchOption as e:
            hint = HINTS.get(e.option_name)
            msg = f"{e.option_name}: {hint}" if hint else f"{e.format_message()} (see {prog_name} --help)"
            click.echo(f"dslaunch: error: {msg}", err=True)
            sys.exit(2)
        except click.BadParameter as e:
            var = _from_environment(e.ctx, e.param)
            hint = "" if e.ctx is None else f" (see {e.ctx.command_path} --help)"
            msg = f"{var} in the environment ({e.param.opts[0]}): {e.message}" if var else e.format_message()
            click.echo(f"dslaunch: error: {msg}{hint}", err=True)
            sys.exit(2)
        except click.UsageError as e:
            hint = "" if e.ctx is None else f" (see {e.ctx.command_path} --help)"
            click.echo(f"dslaunch: error: {e.format_message()}{hint}", err=True)
            sys.exit(2)
        except click.ClickException as e:
            click.echo(f"dslaunch: error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        sys.exit(rv or 0)


@click.command(
    cls=_LaunchCommand,
    epilog=_epilog(),
    context_settings={
        "auto_envvar_prefix": ENV_PREFIX,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Print dslaunch's version and exit.")
# -- layout
@option("--num_gpus", "--num_accelerators", "--nproc_per_node", "--nproc-per-node", type=int, default=None,
        help="Workers per node. Default: every visible GPU; with no GPU, 1 worker process on the CPU.")
@option("--num_nodes", type=int, default=None, help="Use the first N hosts of the hostfile.")
@option("-H", "--hostfile", type=str, default=None, help="MPI-style hostfile: `[user@]host slots=N` per line.")
@option("-i", "--include", type=str, default="", help="Only these hosts/slots, e.g. worker-0@worker-1:0,2.")
@option("-e", "--exclude", type=str, default="", help="All but these hosts/slots, e.g. worker-1:0.")
@option("--master_addr", "--master-addr", type=str, default=None,
        help="Rendezvous address. Default: 127.0.0.1 on one machine, else the first node.")
@option("--master_port", "--master-port", type=int, default=None,
        help=f"Rendezvous port; 0 picks a free one. Default: {DEFAULT_MASTER_PORT}, or on one machine a free "
             f"port when {DEFAULT_MASTER_PORT} is taken (another job), as the launcher then says.")
@option("--standalone", is_flag=True, default=False,
        help="torchrun's spelling: this machine only, on a free port (--master_port 0).")
# -- what each worker runs
@option("-m", "--module", is_flag=True, default=False, help="SCRIPT is a module name (python -m SCRIPT).")
@option("--no_python", is_flag=True, default=False, help="SCRIPT is a program to run directly, not with python.")
@option("--no_local_rank", is_flag=True, default=False, help="Do not pass --local_rank=N to the script.")
@option("--env_file", type=str, default=None,
        help="KEY=VALUE file for every worker, instead of the .deepspeed_env/.dslaunch_env files of ~ and ./.")
@option("--bind_cores_to_rank", is_flag=True, default=False,
        help="Pin each worker's threads to its own share of the node's cores; OMP_NUM_THREADS to match.")
@option("--bind_core_list", type=str, default=None,
        help="With --bind_cores_to_rank: the cores to share out, e.g. 0-15,32-47 (default: one per physical core).")
# -- supervision and output
@option("--log_dir", "--enable_each_rank_log", type=str, default=None,
        help="Also write each rank's output to LOG_DIR/rank_<N>.log.")
@option("--max_restarts", "--max-restarts", type=int, default=0, show_default=True,
        help="Restart the whole job up to N times after a failure.")
@option("--kill_grace", type=float, default=5.0, show_default=True,
        help="Seconds between SIGTERM and SIGKILL when stopping workers.")
@option("--save_pid", is_flag=True, default=False,
        help="Write this launcher's pid to /tmp/<pid>.deepspeed while the job runs (as DeepSpeed does).")
@option("--dry_run", is_flag=True, default=False, help="Print the plan (nodes, ranks, devices, env, commands); run nothing.")
@option("--json", "json", is_flag=True, default=False, help="With --dry_run: print the plan as JSON.")
# -- other hosts
@option("--launcher", type=click.Choice(backends.names()),
        default="ssh", show_default=True, help="How to start work on other hosts (see docs/launching.md).")
@option("--launcher_args", default="", help="Extra arguments for pdsh/mpirun/srun, split like a shell would.")
@option("--force_multi", is_flag=True, default=False,
        help="Start even this machine's hosts through --launcher (e.g. ssh to localhost), as DeepSpeed does.")
@ssh_options
@option("--workdir", default=None, help="Working directory on the other hosts (default: the current one).")
@option("--export", "export", multiple=True,
        help="NAME or NAME=VALUE: also send this variable to remote workers (repeatable; a VALUE goes to every worker).")
@option("--show_env", is_flag=True, default=False, help="Print env values in --dry_run instead of *** for secrets.")
@option("--skip_check", "--no_ssh_check", is_flag=True, default=False, help="Skip the preflight check before a multi-node launch.")
@option("--heartbeat_timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT, show_default=True,
        help="Seconds of silence after which the head declares a host lost and an agent its head.")
# -- elastic jobs (docs/elastic.md)
@option("--min_nodes", "--min_elastic_nodes", type=int, default=None,
        help="Elastic: go on after losing hosts while at least N remain (re-planned, resumed from the last "
             "checkpoint).")
@option("--max_nodes", "--max_elastic_nodes", type=int, default=None,
        help="Elastic: run on at most N hosts of the hostfile; hosts that answer again join up to N "
             "(default: every host).")
@option("--elastic_training", is_flag=True, default=False,
        help="DeepSpeed's spelling: an elastic job (--min_nodes 1 unless given).")
@option("--nnodes", type=str, default=None, help="torchrun's spelling: MIN:MAX is --min_nodes MIN --max_nodes MAX.")
@option("--checkpoint_dir", type=str, default=None,
        help="The runtime saves here (every --checkpoint_every steps, and before a host leaves) and resumes from "
             "the latest complete checkpoint here when the job starts.")
@option("--checkpoint_every", type=int, default=None, help="With --checkpoint_dir: save every N optimizer steps.")
# -- autotuning (docs/autotuning.md)
@option("--autotuning", type=click.Choice(["tune", "run"]), default=None,
        help="tune: try configurations from the config's `autotuning` section and write the results; "
             "run: tune, then train with the best.")
@option("--autotuning_budget", type=float, default=None,
        help="With --autotuning: seconds the trials may take in all (default 3600).")
@option("--autotuning_repeats", type=int, default=None,
        help="With --autotuning: interleaved re-runs of the best 3 trials that decide the winner (default 3; "
             "0: rank by the single tuning runs).")
@option("--autotuning_memory_limit", type=str, default=None,
        help="With --autotuning: bytes one rank may use, e.g. 2GiB (default: measured free memory).")
# -- DeepSpeed options refused (see REFUSED)
@option("--no_ssh", is_flag=True, default=False, help="Refused: dslaunch starts the other nodes itself.")
@click.argument("script", type=str)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(**params) -> int:
    """Start and supervise one worker per GPU (or per slot of each host of a hostfile).

    Every line a worker prints arrives whole, prefixed with its rank; the first failing
    worker stops the job, and dslaunch exits with its exit code (128+N for signal N).
    """
    from dslaunch.launcher.launch import launch as run_launch
    from dslaunch.launcher.options import LaunchOptions

    try:
        for name, why in REFUSED.items():
            if params.pop(name) not in (None, False):
                raise LaunchConfigError(why)
        _elastic_spellings(params)
        tuning = {k: params.pop(k) for k in ("autotuning", "autotuning_budget", "autotuning_memory_limit",
                                               "autotuning_repeats")}
        if params.pop("standalone"):
            if params["hostfile"]:
                raise LaunchConfigError("--standalone means this machine only: drop it or --hostfile")
            if params["master_port"] is None:
                params["master_port"] = 0
        if tuning["autotuning"] is not None:
            return _autotune(tuning, LaunchOptions(**params))
        for name in ("autotuning_budget", "autotuning_memory_limit", "autotuning_repeats"):
            if tuning[name] is not None:
                raise LaunchConfigError(f"--{name} needs --autotuning tune|run")
        return run_launch(LaunchOptions(**params))
    except LaunchConfigError as e:
        click.echo(f"dslaunch: error: {_with_variable(str(e))}", err=True)
        return e.exit_code


def _elastic_spellings(params) -> None:
    """DeepSpeed's --elastic_training and torchrun's --nnodes MIN:MAX, as --min_nodes/--max_nodes."""
    from dslaunch.launcher.elastic import parse_nnodes

    nnodes = params.pop("nnodes")
    if nnodes is not None:
        lo, hi = parse_nnodes(nnodes)
        for name, value in (("min_nodes", lo), ("max_nodes", hi)):
            if params[name] is not None and params[name] != value:
                raise LaunchConfigError(f"--nnodes {nnodes} and --{name} {params[name]} disagree: give one")
            params[name] = value
    if params.pop("elastic_training") and params["min_nodes"] is None and params["max_nodes"] is None:
        params["min_nodes"] = 1


def _autotune(tuning, opts) -> int:
    from dslaunch.launcher.autotune.driver import DEFAULT_BUDGET_S, DEFAULT_REPEATS, Settings, autotune
    from dslaunch.launcher.autotune.memory import parse_bytes
    from dslaunch.launcher.options import check_seconds

    budget = tuning["autotuning_budget"]
    if budget is None:
        budget = DEFAULT_BUDGET_S
    check_seconds("--autotuning_budget", budget, allow_min=False)
    limit = tuning["autotuning_memory_limit"]
    repeats = tuning["autotuning_repeats"]
    if repeats is None:
        repeats = DEFAULT_REPEATS
    if repeats < 0 or repeats == 1:
        raise LaunchConfigError(f"--autotuning_repeats {repeats}: give 0 (no re-runs) or 2 or more (one re-run "
                                "has no spread to tell noise from a difference)")
    return autotune(opts, Settings(tuning["autotuning"], budget, None if limit is None else parse_bytes(limit),
                                   repeats))
