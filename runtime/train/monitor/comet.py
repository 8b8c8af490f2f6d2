"""`deepspeed.monitor.comet`: DeepSpeed's module for CometMonitor (runtime/monitor/monitor.py)."""
from .monitor import CometMonitor

__all__ = ["CometMonitor"]
