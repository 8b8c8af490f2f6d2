"""Pipeline parallelism (`deepspeed.pipe`): layers cut into stages over a process topology.

Pure parts: `partition` (which layers each stage owns) and `schedule` (the 1F1B training
and the inference instruction streams).
"""
from ..topology import ProcessTopology
from .schedule import InferenceSchedule, TrainSchedule

__all__ = ["ProcessTopology", "TrainSchedule", "InferenceSchedule"]
