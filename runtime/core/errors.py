"""The failure types raised on more than one floor: CheckpointError, DeepSpeed's
ZeRORuntimeException (deepspeed.runtime.zero.utils, compat/paths.py), and the refusals that
are also the builtin type DeepSpeed raises at the same place (so its scripts and tests
catch them as before).

Every problem with a checkpoint (a bad tag, an unwritable or full disk, a missing,
damaged or foreign file, a model that does not match) is a CheckpointError whose message
is one line naming the file or key. Uncaught in a training script it prints as that one
line and exit status 2 (dslaunch.runtime installs the hook); `dslaunch consolidate`
prints it the same way. It lives in core/ because the ZeRO stages (their shard
arithmetic) and inference raise it as well as checkpoint/.
"""
from __future__ import annotations

from dslaunch.launcher.errors import OneLineMessage

from .strict import ConfigError


class CheckpointError(OneLineMessage, RuntimeError):
    pass


class CheckpointDirError(CheckpointError, ValueError):
    """No checkpoint directory given (None or ""): DeepSpeed raises a ValueError here."""


class TagMismatchError(CheckpointError, AssertionError):
    """checkpoint.tag_validation Fail and the ranks' tags differ: DeepSpeed asserts here, so
    its scripts and tests catch an AssertionError."""


class CoalesceUnsupportedError(OneLineMessage, NotImplementedError):
    """engine.coalesce_grad_reduction() where it cannot hold the reductions (ZeRO stage 0, a
    pipeline): DeepSpeed raises a NotImplementedError here."""


class OptimizerRequiredError(ConfigError, AssertionError):
    """No optimizer where one is needed (ZeRO 1-2, backward, step): DeepSpeed asserts here,
    so its tests catch an AssertionError."""


class ModelRequiredError(ConfigError, AssertionError):
    """initialize without a model (none given, or the model passed in `args`' place):
    DeepSpeed asserts here, so its tests catch an AssertionError."""


class ZeRORuntimeException(Exception):
    """The class DeepSpeed raises its ZeRO refusals as. dslaunch's refusals that DeepSpeed
    raises as this (a client optimizer under offload_optimizer with zero_force_ds_cpu_optimizer,
    train/optimizer_policy.py) are ConfigErrors that are also ZeRORuntimeExceptions, so code
    catching either catches them."""
