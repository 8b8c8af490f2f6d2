"""deepspeed.checkpoint: dslaunch's checkpoint package (dslaunch.runtime.checkpoint) plus
DeepSpeed's `deepspeed.checkpoint.utils` helpers that Accelerate calls."""
from dslaunch.runtime.train.checkpoint import *  # noqa: F401,F403
from dslaunch.runtime.train.checkpoint import CheckpointError  # noqa: F401

from . import utils  # noqa: F401
from dslaunch.runtime.train.checkpoint.constants import *  # noqa: F401,F403,E402  (DeepSpeed exports its key names here)
