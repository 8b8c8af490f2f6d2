"""Entry point of the `dslaunch` console script.

`dslaunch [OPTIONS] SCRIPT [ARGS]...` launches a job; a few words in the script's place
name subcommands instead. Each subcommand lives beside the code it drives and is
imported only when asked for, so launching never pays for torch or the kernel builder.
A script whose file name collides with a subcommand is launched as `./NAME`.
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# subcommand word -> "module:click command"
SUBCOMMANDS = {
    "check": "dslaunch.launcher.preflight:check",
    "build-ops": "dslaunch.kernels.build_cli:build_ops",
    "consolidate": "dslaunch.runtime.checkpoint.consolidate:consolidate",
}
LAUNCH_COMMAND = "dslaunch.launcher.cli:launch"


def _load(target: str):
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        command = _load(SUBCOMMANDS[args[0]])
        command.main(args=args[1:], prog_name=f"dslaunch {args[0]}")
    else:
        _load(LAUNCH_COMMAND).main(args=args, prog_name="dslaunch")


if __name__ == "__main__":
    main()
