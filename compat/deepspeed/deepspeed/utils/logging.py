"""`deepspeed.utils.logging`: DeepSpeed's logger, which here is dslaunch.runtime's."""
from . import log_dist, log_dist_once, logger, set_log_level_from_string  # noqa: F401  (one logger for both paths)
