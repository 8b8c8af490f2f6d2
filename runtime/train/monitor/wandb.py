"""`deepspeed.monitor.wandb`: DeepSpeed's module for WandbMonitor (runtime/monitor/monitor.py)."""
from .monitor import WandbMonitor

__all__ = ["WandbMonitor"]
