"""One launch, start to end: facts -> plan -> notices -> dry run, or run here / through a backend.

Nothing starts until the whole plan is built and checked (hostfile, filters, env files,
--log_dir, the backend's tool): a usage error is one line and exit 2 with no process
left behind. Both runners (local.run_local and a backend's Head) report through one
JobOutput, so output and failure reports look the same wherever the workers ran.
"""
from __future__ import annotations

import json
import os
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.options import LaunchOptions
from dslaunch.launcher.output import JobOutput, check_log_dir, say

PID_FILE_DIR = "/tmp"  # DeepSpeed's --save_pid location, kept so tools written for it find ours


def _master_addr_of(opts: LaunchOptions):
    def resolve_first(target: str) -> str:
        # the first host's address as SSH resolves it (~/.ssh/config HostName), so workers need no DNS for it
        from dslaunch.launcher.ssh import SshError, resolve

        try:
            return resolve(target, opts.ssh).hostname
        except SshError as exc:
            raise LaunchConfigError(str(exc)) from None

    return resolve_first


def _pick_port(facts):
    from dslaunch.launcher.machine import is_local, pick_free_port

    def pick(addr: str) -> int:
        if is_local(addr, facts.hostnames):
            return pick_free_port(addr)
        # no port can be proven free on another host from here: pick an unlikely one
        return random.randint(20000, 40000)

    return pick


@contextmanager
def saved_pid(enabled: bool, err) -> Iterator[None]:
    """--save_pid: /tmp/<pid>.deepspeed holds the pid to signal to stop the job, as in DeepSpeed."""
    if not enabled:
        yield
        return
    path = Path(PID_FILE_DIR) / f"{os.getpid()}.deepspeed"
    path.write_text(str(os.getpid()))
    say(err, f"launcher pid: {os.getpid()} (saved in {path})")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)


def launch(opts: LaunchOptions) -> int:
    from dslaunch.launcher import backends
    from dslaunch.launcher.machine import gather_facts, port_in_use
    from dslaunch.launcher.plan import build_plan, uses_allocation
    from dslaunch.launcher.plan_view import format_plan, plan_to_dict

    environ = dict(os.environ)
    facts = gather_facts(environ, need_addresses=opts.hostfile is not None or uses_allocation(opts, environ))
    plan = build_plan(opts, facts, environ, pick_port=_pick_port(facts),
                      master_addr_of=_master_addr_of(opts) if opts.hostfile else None, port_in_use=port_in_use)
    if plan.elastic is not None:
        _elastic_closures(plan, opts, facts, environ)
    backend = backends.get(opts.launcher) if plan.remote_nodes else None
    if not opts.dry_run:  # a dry run needs neither the tool nor the log directory
        if backend is not None:
            backend.check(plan)
        if opts.log_dir:
            check_log_dir(opts.log_dir, range(plan.world.world_size))
    err = sys.stderr.buffer
    for note in plan.notes + plan.env_files.notices():
        say(err, note)
    if opts.dry_run:
        info = backend.describe(plan) if backend is not None else None
        text = json.dumps(plan_to_dict(plan, info), indent=2) if opts.json else format_plan(plan, info)
        sys.stdout.write(text + "\n")
        return 0
    from dslaunch.launcher.keeper import fork_keeper

    fork_keeper(opts.kill_grace)  # from here on this is the job process, below a keeper (keeper.py)
    output = JobOutput(sys.stdout.buffer, err, opts.log_dir, plan.run_id)
    err_fd = _fileno(err)
    code = 1
    try:
        with saved_pid(opts.save_pid, err):
            if backend is None:
                from dslaunch.launcher.local import run_local
                code = run_local(plan, output, environ, err_fd)
            else:
                code = backend.run(plan, output, err_fd)
    except KeyboardInterrupt:  # Ctrl-C while connecting or in the preflight, before any worker started
        output.say("interrupted before the job started")
        code = 130
    finally:
        try:
            output.close()
        except KeyboardInterrupt:  # Ctrl-C while a stalled reader holds the last lines: give them up
            code = code or 130
    return code


def _elastic_closures(plan, opts: LaunchOptions, facts, environ) -> None:
    """What an elastic head needs to plan again: the same options and machine facts, the same
    run id and port, the global batch's size kept (the first plan's world)."""
    from dslaunch.launcher.plan import build_plan, resolve_hosts
    from dslaunch.launcher.world import layout_world

    base_world = plan.world.world_size
    master_addr_of = _master_addr_of(opts)

    def replan(targets):
        names = [t.rpartition("@")[2] for t in targets]
        new = build_plan(opts, facts, environ, run_id=plan.run_id, master_addr_of=master_addr_of,
                         only_hosts=names, base_world=base_world, pick_port=lambda addr: plan.master_port)
        new.replan, new.hosts_now = replan, hosts_now
        return new

    def hosts_now():
        world = layout_world(resolve_hosts(opts, facts, environ), include=opts.include, exclude=opts.exclude,
                             num_gpus=opts.num_gpus)
        return [(n.target, n.local_world_size) for n in world.nodes]

    plan.replan, plan.hosts_now = replan, hosts_now


def _fileno(stream) -> Optional[int]:
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):
        return None
