"""dslaunch.runtime.comm: every collective of the runtime goes through here; also
`deepspeed.comm` for scripts that do `import dslaunch.runtime as deepspeed`.

    backend.py      init_distributed (launcher env, MPI env, single-process fallback; timeout=)
    groups.py       get_rank/get_world_size(group), new_group (named, destroyed at exit), ...
    collectives.py  all_reduce, reduce_scatter_tensor, all_gather_into_tensor (gloo fallbacks),
                    broadcast, barrier, send/recv/isend/irecv, all_gather_object, ... each
                    recorded in the flight record with its group, bytes and the caller's label
    flight.py       the per-rank flight record of the last collectives; naming a mismatch
    watchdog.py     a collective unfinished after the timeout: stacks, flight records, the
                    mismatch named, exit 124 on every reachable rank
    logger.py       the comms logger: latency, algbw/busbw per op and message size
    traffic.py      ... and bytes by process group and host pair (traffic_report)
    shm.py          collectives through shared memory for groups on one host
    shm_p2p.py      send/recv through shared-memory rings for flows between ranks of one host
    shutdown.py     orderly teardown at interpreter exit

Importing this package registers the exit handler (shutdown.py).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

from ..strict import ConfigError
from . import shutdown, watchdog
from .backend import default_backend, get_local_rank, init_distributed, local_rank, world_source
from .collectives import (ReduceOp, all_gather, all_gather_into_tensor, all_gather_object, all_reduce,
                          all_to_all_single, allgather_fn, barrier, broadcast, broadcast_object_list, comms_logger,
                          force_fallback, gather, has_all_gather_into_tensor, has_reduce_scatter_tensor,
                          inference_all_reduce, irecv, isend, labelled, monitored_barrier, recorder, recv, reduce, scope_label,
                          release_completed,
                          reduce_scatter, reduce_scatter_fn, reduce_scatter_tensor, scatter, send)
from .coalesced import P2POp, all_gather_coalesced, all_reduce_coalesced, all_to_all, batch_isend_irecv
from .shm_p2p import connect as connect_same_host_p2p, wait_all as wait_p2p_sends
from .groups import (destroy_process_group, get_all_ranks_from_group, get_global_rank, get_rank, get_world_group,
                     get_world_size, group_name, is_available, is_initialized, new_group)

__all__ = [
    "init_distributed", "is_initialized", "is_available", "destroy_process_group", "new_group", "get_rank",
    "get_world_size", "get_local_rank", "get_global_rank", "get_world_group", "get_all_ranks_from_group",
    "ReduceOp", "labelled", "scope_label", "all_reduce", "inference_all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_fn", "all_gather", "all_gather_into_tensor", "allgather_fn", "broadcast", "gather", "scatter",
    "all_to_all_single", "all_gather_object", "broadcast_object_list", "barrier", "monitored_barrier", "send",
    "recv", "isend", "irecv", "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "configure",
    "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count", "get_logged_comm_ops",
    "set_timeout", "flight_record", "all_to_all", "all_reduce_coalesced", "all_gather_coalesced", "P2POp",
    "batch_isend_irecv", "traffic_report",
]


def configure(deepspeed_config=None, enabled: Optional[bool] = None, prof_all: Optional[bool] = None,
              prof_ops=None, verbose: Optional[bool] = None, debug: Optional[bool] = None,
              timeout: Optional[float] = None) -> None:
    """deepspeed.comm.configure: the comms logger and the collective watchdog's timeout, from
    plain values (the engine passes its config's `comms_logger` section and `comms_timeout`).

    `deepspeed_config`, DeepSpeed's first parameter, is a parsed config
    (`DeepSpeedConfig(...)`): its `comms_logger` section and `comms_timeout` are read by
    attribute, as DeepSpeed reads its config's comms section (this package knows no config
    schema and imports none); explicit values win over it."""
    if deepspeed_config is not None:
        section = getattr(deepspeed_config, "comms_logger", None)
        if section is None or not hasattr(deepspeed_config, "comms_timeout"):
            raise ConfigError(f"comm.configure: deepspeed_config must be a parsed config (DeepSpeedConfig(...)), "
                              f"got {type(deepspeed_config).__name__}; or pass enabled=/prof_all=/prof_ops=/"
                              "verbose=/debug= directly")
        comms_logger.configure(section.enabled, section.verbose, section.prof_all, section.prof_ops, section.debug)
        if deepspeed_config.comms_timeout is not None:
            watchdog.set_timeout(deepspeed_config.comms_timeout)
    comms_logger.configure(enabled, verbose, prof_all, prof_ops, debug)
    if timeout is not None:
        watchdog.set_timeout(timeout)


def set_timeout(seconds: float) -> None:
    """The collective watchdog's timeout, in seconds (also the config's comms_timeout)."""
    watchdog.set_timeout(seconds)


def flight_record() -> list:
    """This rank's last collectives, oldest first (dicts: seq, op, group, nbytes, label, state...)."""
    import time

    now = time.monotonic()
    return [e.as_dict(now) for e in recorder.entries()]


def _this_rank() -> int:
    return get_rank() if is_initialized() else int(os.environ.get("RANK", "0"))


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Optional[Dict[str, Any]]:
    """deepspeed.comm.log_summary: rank 0 prints a table per op and message size (count,
    latency, algbw/busbw, groups). Collective over the default group (a barrier before and
    after, and with show_straggler an all_gather_object of every rank's latencies: the
    straggler column is the slowest rank's total latency minus the fastest one's)."""
    world = get_world_group()
    barrier(group=world, log_name="log_summary_barrier")
    stragglers = None
    if show_straggler:
        mine = {n: {size: s["total_latency_ms"] for size, s in sizes.items()}
                for n, sizes in comms_logger.summary_dict().items()}
        everyone = [None] * get_world_size(world)
        all_gather_object(everyone, mine, group=world, log_name="log_summary_straggler")
        stragglers = {}
        for n, sizes in mine.items():
            for size in sizes:
                totals = [d.get(n, {}).get(size, 0.0) for d in everyone]
                stragglers.setdefault(n, {})[size] = max(totals) - min(totals)
    if _this_rank() == 0:
        print(comms_logger.summary(stragglers), flush=True)
    barrier(group=world, log_name="log_summary_barrier")
    if return_dict:
        return {"summary": comms_logger.summary_dict(), "straggler_analysis": stragglers,
                "metadata": {"world_size": get_world_size(world), "rank": _this_rank()}}
    return None


def traffic_report():
    """Collective over the default group: every rank's byte counts (the comms logger's
    `traffic`) and the host of every rank, as one traffic.TrafficReport on every rank."""
    from .traffic import TrafficReport, host_key

    mine = (host_key(), comms_logger.traffic.snapshot())
    world = get_world_group()
    everyone = [None] * get_world_size(world)
    all_gather_object(everyone, mine, group=world, log_name="traffic_report")
    return TrafficReport([h for h, _ in everyone], [rows for _, rows in everyone])


def reset_log() -> None:
    comms_logger.reset()


def has_comm_data() -> bool:
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    return comms_logger.total_operations()


def get_logged_comm_ops() -> list:
    return comms_logger.operation_names()


def _end_of_run_summary() -> None:
    if comms_logger.enabled and comms_logger.has_data() and _this_rank() == 0:
        print(f"comms_logger: communication summary of rank 0 at exit\n{comms_logger.summary()}", file=sys.stdout,
              flush=True)


shutdown.install()
shutdown.register_first(lambda failed: watchdog.stop(leaving=True, failed=failed))
shutdown.register_first(lambda failed: recorder.forget_handles())  # the exit handler waits on its own list
shutdown.register_report(_end_of_run_summary)
