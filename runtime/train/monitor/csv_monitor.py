"""`deepspeed.monitor.csv_monitor`: DeepSpeed's module for csvMonitor (runtime/monitor/monitor.py)."""
from .monitor import csvMonitor

__all__ = ["csvMonitor"]
