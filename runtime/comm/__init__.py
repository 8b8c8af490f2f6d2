"""dslaunch.runtime.comm: process-group set-up and the runtime's orderly shutdown.

Importing this package registers the exit handler (shutdown.py) that destroys the
process groups before the interpreter finalises.
"""
from . import shutdown
from .backend import (default_backend, get_rank, get_world_size, init_distributed, is_initialized, local_rank,
                      world_source)

shutdown.install()

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "local_rank", "world_source",
           "default_backend"]
