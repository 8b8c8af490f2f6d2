"""`deepspeed.utils.comms_logging`: DeepSpeed's module for the comms logger; the logger is
dslaunch's (runtime/comm/logger.py), the one deepspeed.comm records into."""
from ..core.comm.logger import CommsLogger, bandwidths_gbps, bus_factor

__all__ = ["CommsLogger", "bandwidths_gbps", "bus_factor"]
