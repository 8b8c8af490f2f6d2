"""`deepspeed.constants`: the names DeepSpeed's launcher and Megatron-DeepSpeed read.
CROSS_RANK/CROSS_SIZE are environment variable names dslaunch's launcher sets too."""
import os
from datetime import timedelta

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
default_pg_timeout = timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", "10")))
INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
