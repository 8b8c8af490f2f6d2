"""`comms_logger`: the communication logger's section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..strict import refused

LATER = "the communication logger is not available yet; remove it"


@dataclass
class CommsLoggerConfig:
    enabled: Any = refused(LATER, False)
    verbose: Any = refused(LATER, False)
    prof_all: Any = refused(LATER, True)
    prof_ops: Any = refused(LATER, None, [])
    debug: Any = refused(LATER, False)
