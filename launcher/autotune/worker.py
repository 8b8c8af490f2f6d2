"""What each rank of a trial runs: the user's script, stopped cleanly when measured.

`python -m dslaunch.launcher.autotune.worker [--local_rank=N] [-m] TARGET ARGS...` runs
TARGET (a script path, or with -m a module) as __main__ with the argv it would have had
under a plain launch (`TARGET --local_rank=N ARGS...`). When the engine raises
TrialComplete after end_profile_step (dslaunch.runtime.autotuning), the script has
unwound through its own `finally` blocks and context managers; this wrapper catches it
and returns, and the process exits 0 through the runtime's orderly shutdown. Any other
exception propagates unchanged, so a crashing trial is reported as it would be in a
plain launch.
"""
from __future__ import annotations

import os
import runpy
import sys


def _is_trial_complete(exc: BaseException) -> bool:
    # Looked up only when something was raised: the runtime (and torch) is imported by the
    # script, never by this wrapper before it.
    mod = sys.modules.get("dslaunch.runtime.train.autotuning")
    return mod is not None and isinstance(exc, mod.TrialComplete)


def main(argv) -> int:
    args = list(argv)
    local_rank = [args.pop(0)] if args and args[0].startswith("--local_rank=") else []
    module = bool(args) and args[0] == "-m"
    if module:
        args.pop(0)
    if not args:
        print("dslaunch.launcher.autotune.worker: no script given", file=sys.stderr)
        return 2
    target, rest = args[0], args[1:]
    sys.argv = [target, *local_rank, *rest]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
    except BaseException as exc:
        if _is_trial_complete(exc):
            return 0
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
