"""deepspeed.launcher.runner: the `deepspeed` command, which is dslaunch.

Accelerate's multi-node DeepSpeed path runs `deepspeed --hostfile H --launcher pdsh
--no_local_rank --num_gpus N --master_addr A --master_port P script ...` after appending the
job's environment to DEEPSPEED_ENVIRONMENT_NAME in the working directory; dslaunch takes the
same options and exports that file to every worker (as it does .dslaunch_env).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from dslaunch.launcher.envfile import DEEPSPEED_ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME  # ".deepspeed_env"

DLTS_HOSTFILE = "/job/hostfile"  # DeepSpeed's default hostfile path, for code that reads the constant


def main(args: Optional[Sequence[str]] = None) -> None:
    from dslaunch.launcher.main import main as dslaunch_main

    dslaunch_main(list(sys.argv[1:] if args is None else args))


if __name__ == "__main__":
    main()
