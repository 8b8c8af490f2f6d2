"""`deepspeed.monitor.tensorboard`: DeepSpeed's module for TensorBoardMonitor (runtime/monitor/monitor.py)."""
from .monitor import TensorBoardMonitor

__all__ = ["TensorBoardMonitor"]
