"""The one checkpoint failure type.

Every problem with a checkpoint (a bad tag, an unwritable or full disk, a missing,
damaged or foreign file, a model that does not match) is a CheckpointError whose message
is one line naming the file or key. Uncaught in a training script it prints as that one
line and exit status 2 (dslaunch.runtime installs the hook); `dslaunch consolidate`
prints it the same way. It lives in core/ because the ZeRO stages (their shard
arithmetic) and inference raise it as well as checkpoint/.
"""
from __future__ import annotations

from dslaunch.launcher.errors import OneLineMessage


class CheckpointError(OneLineMessage, RuntimeError):
    pass
