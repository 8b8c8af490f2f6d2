"""Entry point of the `dslaunch` console script.

`dslaunch [OPTIONS] SCRIPT [ARGS]...` launches a job; a few words in the script's place
name subcommands instead. Each subcommand lives beside the code it drives and is
imported only when asked for, so launching never pays for torch or the kernel builder.
A script whose file name collides with a subcommand is launched as `./NAME`.

To add a subcommand: one line in SUBCOMMANDS (its word, its click command, its one-line
description for `dslaunch --help`).
"""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

# word -> ("module:click command", one line for `dslaunch --help`)
SUBCOMMANDS = {
    "check": ("dslaunch.launcher.preflight:check", "preflight every host of a hostfile: ssh, python, torch, GPUs, master"),
    "build-ops": ("dslaunch.kernels.build_cli:build_ops", "build the fused optimizer kernels ahead of time into the shared cache"),
    "consolidate": ("dslaunch.runtime.train.checkpoint.consolidate:consolidate", "write a (ZeRO) checkpoint as one fp32 state_dict file"),
    "ds_to_universal": ("dslaunch.runtime.train.checkpoint.ds_to_universal:ds_to_universal", "write a checkpoint (ours or DeepSpeed's) in DeepSpeed's universal layout"),
    "drain": ("dslaunch.launcher.control:drain", "take a host out of a running elastic job (it saves first)"),
    "undrain": ("dslaunch.launcher.control:undrain", "let a drained host join its elastic job again"),
    "install-deepspeed-compat": ("dslaunch.compat.install:install_deepspeed_compat", "install (or --uninstall) the `deepspeed` package that runs HF Trainer/Accelerate on dslaunch"),
}
LAUNCH_COMMAND = "dslaunch.launcher.cli:launch"


def _load(target: str):
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        command = _load(SUBCOMMANDS[args[0]][0])
        command.main(args=args[1:], prog_name=f"dslaunch {args[0]}")
    else:
        from dslaunch.launcher import keeper

        keeper.enable()  # this process is a launch: it may become the job's keeper (keeper.py)
        _load(LAUNCH_COMMAND).main(args=args, prog_name="dslaunch")


if __name__ == "__main__":
    main()
