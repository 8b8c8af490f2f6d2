"""Process-group set-up from whichever launcher started us.

dslaunch, torchrun and DeepSpeed's launcher all export RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; mpirun exports OMPI_COMM_WORLD_*. With none of these (plain
`python train.py`) this becomes a one-process group on a free loopback port, so the same
script runs everywhere.

`timeout` is the collective watchdog's (watchdog.py): a collective unfinished after it is
reported on every rank and ends the job. The default group itself gets a minute more, so
the backend's own timeout never fires first.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..strict import ConfigError
from . import watchdog
from .collectives import recorder


class DistributedNotInitializedError(ConfigError, AssertionError):
    """dist_init_required=False with no process group: DeepSpeed asserts here (so its tests
    catch an AssertionError). Going on would leave each rank of a multi-rank launch training
    alone, without a word."""

_WORLD_SOURCE = None  # set when init_distributed creates the default group


def world_source() -> str:
    """Where the world size came from, for error messages."""
    if _WORLD_SOURCE is not None:
        return _WORLD_SOURCE
    if dist.is_available() and dist.is_initialized():
        return "the default process group the script initialised itself"
    return "single process (no launcher environment)"


def _adopt_mpi_env() -> None:
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ.setdefault("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _seconds(timeout: Union[timedelta, float, int]) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


# Names the MASTER_PORT a one-process init_distributed set (for readers of the environment), in
# this process and in the children that inherit it, so that a later one-process init does not
# take it for the script's own choice: the store on it may still be alive.
OWN_PORT_VAR = "DSLAUNCH_ONE_PROCESS_PORT"


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True,
                     timeout: Union[timedelta, float, None] = None, init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Initialise torch.distributed once (a later call only applies `timeout` and `config`),
    like deepspeed.init_distributed. `timeout` (a timedelta or seconds; default 30 minutes)
    is the collective watchdog's; `config` (a DeepSpeed config dict, path or object)
    applies its comms_logger and comms_timeout."""
    global _WORLD_SOURCE
    if config is not None:
        from . import configure

        configure(deepspeed_config=config)
    if timeout is not None:
        watchdog.set_timeout(_seconds(timeout))
    if dist_init_required is False and not dist.is_initialized():
        raise DistributedNotInitializedError(
            "dist_init_required=False, but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first, or leave dist_init_required unset (initialized here)")
    if dist.is_initialized():
        watchdog.ensure(recorder)
        return
    if auto_mpi_discovery:
        _adopt_mpi_env()
    if rank < 0 and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    if world_size < 0 and "WORLD_SIZE" in os.environ:
        world_size = int(os.environ["WORLD_SIZE"])
        _WORLD_SOURCE = "WORLD_SIZE from the launcher environment"
    store = None
    if rank < 0 or world_size < 0:
        rank, world_size = 0, 1
        _WORLD_SOURCE = "single process (no launcher environment)"
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if distributed_port:
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
        own = os.environ.get("MASTER_PORT") is not None and os.environ.get("MASTER_PORT") == os.environ.get(OWN_PORT_VAR)
        if ("MASTER_PORT" not in os.environ or own) and init_method is None:
            # The store binds port 0 itself: a port probed free and bound later may be taken in
            # between (another process's outgoing connection gets one from the same range).
            store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, 1, True,
                                  timeout=watchdog.backend_timeout(watchdog.timeout_s()))
            os.environ["MASTER_PORT"] = os.environ[OWN_PORT_VAR] = str(store.port)
    elif "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        if init_method is None:
            raise RuntimeError("init_distributed: RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; "
                               "start the job with dslaunch or torchrun")
    backend = dist_backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            store=store, timeout=watchdog.backend_timeout(watchdog.timeout_s()))
    watchdog.ensure(recorder)


def get_local_rank() -> int:
    return local_rank()
