"""`deepspeed.utils.logging`: DeepSpeed's logger, which here is dslaunch.runtime's."""
import logging as _logging

from . import log_dist, logger  # noqa: F401  (one logger for both import paths)

LOG_LEVELS = {"debug": _logging.DEBUG, "info": _logging.INFO, "warning": _logging.WARNING,
              "error": _logging.ERROR, "critical": _logging.CRITICAL}


def set_log_level_from_string(log_level_str: str, custom_logger=None) -> None:
    """Set the logger's level by name ("info", "WARNING", ...), as DeepSpeed's --log_level."""
    level = LOG_LEVELS.get(str(log_level_str).lower())
    if level is None:
        raise ValueError(f"log level {log_level_str!r}: expected one of {', '.join(LOG_LEVELS)}")
    (custom_logger or logger).setLevel(level)
