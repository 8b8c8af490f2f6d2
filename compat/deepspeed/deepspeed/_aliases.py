"""`deepspeed.X.Y` is `dslaunch.runtime.X.Y`: the same module object under a second name.

A finder placed first on sys.meta_path answers for names under `deepspeed.`:
- a module this package ships as a file (deepspeed/utils, deepspeed/launcher, ...) is left
  to the normal path finder;
- `deepspeed.runtime` is dslaunch.runtime itself (EXPLICIT);
- anything else becomes an alias: `deepspeed.<rest>` of a package shipped here maps to
  `<that package's dslaunch counterpart>.<rest>` (the top level's counterpart is
  dslaunch.runtime), and a child of an alias maps to the same child of the aliased module.
Where a DeepSpeed path lives elsewhere in dslaunch.runtime (deepspeed.checkpointing,
deepspeed.module_inject, deepspeed.runtime.zero.stage_1_and_2, ...), dslaunch.runtime's own
alias table answers (dslaunch.compat.paths, the one table of DeepSpeed's module paths).
Aliasing (instead of a file that star-imports) keeps one copy of every module, so class
identity holds (`isinstance(engine, deepspeed.runtime.engine.DeepSpeedEngine)`) and module
state (the registered ZeRO strategies, the process-group bookkeeping) is shared.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

from dslaunch.compat import paths

PREFIX = "deepspeed"
# Packages shipped here whose missing children map somewhere other than dslaunch.runtime.<same path>.
COUNTERPARTS = {
    "deepspeed": "dslaunch.runtime",
    "deepspeed.checkpoint": "dslaunch.runtime.checkpoint",
    "deepspeed.launcher": "dslaunch.launcher",
    "deepspeed.utils": "dslaunch.runtime.utils",
}


# The one DeepSpeed name that is not dslaunch.runtime.<same path>: the runtime package itself.
EXPLICIT = {"deepspeed.runtime": "dslaunch.runtime"}


def target_of(fullname: str) -> str | None:
    """The dslaunch module `fullname` aliases, or None when a file here provides it."""
    parent_name, _, leaf = fullname.rpartition(".")
    if fullname in EXPLICIT:
        return EXPLICIT[fullname]
    parent = sys.modules.get(parent_name)
    if parent is None:
        return None
    if parent.__name__ != parent_name:  # the parent is itself an alias: follow it
        # unless dslaunch.runtime's alias table names this very path (deepspeed.ops.aio, whose
        # parent deepspeed.ops is dslaunch.runtime.train.ops, is the table's "ops.aio")
        rest = fullname[len("deepspeed.runtime."):] if fullname.startswith("deepspeed.runtime.") else \
            fullname[len("deepspeed."):]
        if rest in paths.PATHS:
            return f"{paths.PACKAGE}.{rest}"
        return f"{parent.__name__}.{leaf}"
    for folder in getattr(parent, "__path__", ()):
        if os.path.exists(os.path.join(folder, leaf + ".py")) or os.path.isdir(os.path.join(folder, leaf)):
            return None  # shipped here
    base = COUNTERPARTS.get(parent_name)
    return f"{base}.{leaf}" if base else None


class AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PREFIX + "."):
            return None
        dest = target_of(fullname)
        if dest is None:
            return None
        try:
            spec = importlib.util.find_spec(dest)
        except ImportError:  # dest's parent is a plain module, or missing
            return None
        if spec is None:
            return None
        return paths.AliasSpec(fullname, paths.AliasLoader(dest), dest, origin=spec.origin,
                               is_package=spec.submodule_search_locations is not None)


_FINDER = AliasFinder()


def install() -> None:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
