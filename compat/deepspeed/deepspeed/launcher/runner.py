"""deepspeed.launcher.runner: the `deepspeed` command, which is dslaunch.

Accelerate's multi-node DeepSpeed path runs `deepspeed --hostfile H --launcher pdsh
--no_local_rank --num_gpus N --master_addr A --master_port P script ...` after appending the
job's environment to DEEPSPEED_ENVIRONMENT_NAME in the working directory; dslaunch takes the
same options and exports that file to every worker (as it does .dslaunch_env).

DeepSpeed's hostfile and --include/--exclude parsers are served by dslaunch's
(launcher/hostfile.py, launcher/world.py) under DeepSpeed's names and return types; their
errors are ValueErrors, as DeepSpeed's.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Sequence

from dslaunch.launcher.envfile import DEEPSPEED_ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME  # ".deepspeed_env"

DLTS_HOSTFILE = "/job/hostfile"  # DeepSpeed's default hostfile path, for code that reads the constant


def _parse_hostfile(hostfile_lines: Iterable[str]) -> "OrderedDict[str, int]":
    """DeepSpeed's reading of hostfile lines: host -> slots, in file order."""
    from dslaunch.launcher.hostfile import parse_hostfile_text

    return OrderedDict((h.host, h.slots) for h in parse_hostfile_text("\n".join(hostfile_lines)))


def parse_resource_filter(host_info: Dict[str, List[int]], include_str: str = "",
                          exclude_str: str = "") -> "OrderedDict[str, List[int]]":
    """host -> slots kept by DeepSpeed's --include or --exclude syntax (`a@b:0,2`); as in
    DeepSpeed, excluding everything gives an empty mapping (dslaunch's launcher refuses it)."""
    from dslaunch.launcher.world import _apply_filter, check_selection

    check_selection(include_str, exclude_str, None, None)
    pool = OrderedDict((host, list(slots)) for host, slots in host_info.items())
    if not include_str and not exclude_str:
        return pool
    option = "--include" if include_str else "--exclude"
    return _apply_filter(pool, include_str or exclude_str, option, bool(include_str), allow_empty=True)


def main(args: Optional[Sequence[str]] = None) -> None:
    from dslaunch.launcher.main import main as dslaunch_main

    dslaunch_main(list(sys.argv[1:] if args is None else args))


if __name__ == "__main__":
    main()
