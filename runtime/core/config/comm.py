"""`comms_logger` and `comms_timeout`: the communication layer's keys (dslaunch.runtime.comm)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ..strict import supported


@dataclass
class CommsLoggerConfig:
    enabled: bool = supported(False, "record every profiled collective's op, size, group, latency, algbw/busbw; "
                                     "rank 0 prints a table per op and size at exit and on "
                                     "deepspeed.comm.log_summary()")
    verbose: bool = supported(False, "also print each collective as it is recorded")
    prof_all: bool = supported(True, "profile every collective (else only prof_ops and calls with prof=True)")
    prof_ops: List[str] = supported(factory=list, note="op names to profile when prof_all is false")
    debug: bool = supported(False, "append the calling function to each record's name")


COMMS_TIMEOUT_NOTE = ("seconds a collective may take before the watchdog prints every rank's stacks and last "
                      "collectives, names the mismatch and ends the job (exit 124); default 1800")
