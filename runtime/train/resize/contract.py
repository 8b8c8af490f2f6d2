"""The variables `dslaunch` sets for a resizable job, read once and checked.

Names shared with launcher/elastic.py (its docstring lists them). A value that does not
parse is a ConfigError naming the variable: a job that silently did not save would lose
everything the first time a host is lost.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from ...core.strict import ConfigError

SAVE_DIR_VAR = "DSLAUNCH_SAVE_DIR"  # launcher/elastic.py SAVE_DIR_VAR (--checkpoint_dir)
SAVE_EVERY_VAR = "DSLAUNCH_SAVE_EVERY"  # launcher/elastic.py SAVE_EVERY_VAR (--checkpoint_every)
BASE_WORLD_VAR = "DSLAUNCH_BASE_WORLD_SIZE"  # launcher/elastic.py BASE_WORLD_VAR
MAX_WORLD_VAR = "DSLAUNCH_MAX_WORLD_SIZE"  # launcher/elastic.py MAX_WORLD_VAR
AGENT_SOCKET_VAR = "DSLAUNCH_AGENT_SOCKET"  # launcher/elastic.py AGENT_SOCKET_VAR
RESIZE_EXIT_CODE = 75  # launcher/elastic.py RESIZE_EXIT_CODE


@dataclass(frozen=True)
class ResizeEnv:
    save_dir: Optional[str] = None  # save here (and resume from here at initialize)
    save_every: Optional[int] = None  # every this many optimizer steps; None: only for a resize
    base_world: Optional[int] = None  # the world size the global batch is configured for
    max_world: Optional[int] = None  # the largest world size the job may run at
    agent_socket: Optional[str] = None  # the node agent's socket: an elastic job

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.save_dir, self.base_world, self.agent_socket))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "ResizeEnv":
        def number(name: str) -> Optional[int]:
            raw = environ.get(name)
            if raw is None or raw == "":
                return None
            if not raw.isdigit() or int(raw) < 1:
                raise ConfigError(f"${name}={raw!r}: expected a whole number of at least 1")
            return int(raw)

        save_dir = environ.get(SAVE_DIR_VAR) or None
        every = number(SAVE_EVERY_VAR)
        if every is not None and save_dir is None:
            raise ConfigError(f"${SAVE_EVERY_VAR}={every}: needs ${SAVE_DIR_VAR} (where to save)")
        return cls(save_dir, every, number(BASE_WORLD_VAR), number(MAX_WORLD_VAR),
                   environ.get(AGENT_SOCKET_VAR) or None)
