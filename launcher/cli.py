"""The `dslaunch [OPTIONS] SCRIPT [SCRIPT_ARGS]...` command.

Options stop at SCRIPT: everything after it reaches the workers untouched, even words
that look like our options (click: allow_interspersed_args=False + UNPROCESSED args).

Every option also reads DSLAUNCH_<OPTION> from the environment (click's
auto_envvar_prefix, so options added later get a variable without further code), and
--help shows each variable. To add an option: one `@option(...)` below and a field of
the same name in plan.LaunchOptions. Do not name an option after a variable the
workers receive (run_id, restart_count, accelerator, group_id): DSLAUNCH_RUN_ID and
friends are in every worker's environment, so a nested dslaunch would read them.

Usage errors (LaunchConfigError, click's own) print one line and exit 2.
"""
from __future__ import annotations

import json
import os
import sys

import click

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.ssh_options import multinode_options, pop_multinode_options

ENV_PREFIX = "DSLAUNCH"


def option(*decls, **kwargs):
    """click.option whose help always names its DSLAUNCH_* variable."""
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


class _LaunchCommand(click.Command):
    def main(self, args=None, prog_name=None, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.Abort:
            sys.exit(130)
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
    context_settings={
        "auto_envvar_prefix": ENV_PREFIX,
        "allow_interspersed_args": False,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@option("--num_gpus", type=int, default=None,
        help="Workers per node. Default: every visible GPU; with no GPU, 1 worker process on the CPU.")
@option("--num_nodes", type=int, default=None, help="Use the first N hosts of the hostfile.")
@option("--hostfile", type=str, default=None, help="MPI-style hostfile: `[user@]host slots=N` per line.")
@option("--include", type=str, default="", help="Only these hosts/slots, e.g. worker-0@worker-1:0,2.")
@option("--exclude", type=str, default="", help="All but these hosts/slots, e.g. worker-1:0.")
@option("--master_addr", type=str, default=None,
        help="Rendezvous address. Default: 127.0.0.1 on one machine, else the first node.")
@option("--master_port", type=int, default=29500, show_default=True, help="Rendezvous port; 0 picks a free one.")
@option("-m", "--module", is_flag=True, default=False, help="SCRIPT is a module name (python -m SCRIPT).")
@option("--no_python", is_flag=True, default=False, help="SCRIPT is a program to run directly, not with python.")
@option("--no_local_rank", is_flag=True, default=False, help="Do not pass --local_rank=N to the script.")
@option("--log_dir", type=str, default=None, help="Also write each rank's output to LOG_DIR/rank_<N>.log.")
@option("--max_restarts", type=int, default=0, show_default=True,
        help="Restart the whole worker group up to N times after a failure.")
@option("--kill_grace", type=float, default=5.0, show_default=True,
        help="Seconds between SIGTERM and SIGKILL when stopping workers.")
@option("--env_file", type=str, default=None,
        help="KEY=VALUE file exported to every worker. Default: ./.dslaunch_env, else ~/.dslaunch_env.")
@option("--dry_run", is_flag=True, default=False, help="Print the plan (nodes, ranks, devices, env, commands); run nothing.")
@option("--json", "json", is_flag=True, default=False, help="With --dry_run: print the plan as JSON.")
@multinode_options  # --launcher, --ssh_*, --export, --show_env, ... (multi-node, ssh_options.py)
@click.argument("script", type=str)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(**params) -> int:
    """Start and supervise one worker per GPU (or per slot of each host of a hostfile).

    Every line a worker prints arrives whole, prefixed with its rank; the first failing
    worker stops the job, and dslaunch exits with its exit code (128+N for signal N).
    """
    from dslaunch.launcher.plan import LaunchOptions

    try:
        mn = pop_multinode_options(params)
        opts = LaunchOptions(**params)
        return _launch(opts, mn)
    except LaunchConfigError as e:
        click.echo(f"dslaunch: error: {e}", err=True)
        return e.exit_code


def _launch(opts, mn=None) -> int:
    from dslaunch.launcher.local import run_local, say
    from dslaunch.launcher.machine import gather_facts, is_local, pick_free_port
    from dslaunch.launcher.plan import build_plan, format_plan, plan_to_dict

    environ = dict(os.environ)
    facts = gather_facts(environ, need_addresses=opts.hostfile is not None)
    plan = build_plan(opts, facts, environ)
    err = sys.stderr.buffer
    for note in plan.notes:
        say(err, note)
    if plan.master_port == 0 and is_local(plan.master_addr, facts.hostnames):
        plan.master_port = pick_free_port(plan.master_addr)
    if plan.remote_nodes:  # other hosts: the multi-node hand-off (SSH agents, pdsh, mpirun, srun), --dry_run too
        from dslaunch.launcher.multinode import run_plan
        return run_plan(plan, mn or pop_multinode_options({}), environ)
    if opts.dry_run:
        text = json.dumps(plan_to_dict(plan), indent=2) if opts.json else format_plan(plan)
        click.echo(text)
        return 0
    return run_local(plan, environ=environ)
