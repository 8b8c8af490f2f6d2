"""Where DeepSpeed's module paths live in dslaunch.runtime: the one alias table.

Scripts that do `import dslaunch.runtime as deepspeed` import DeepSpeed's module paths under
dslaunch.runtime (`dslaunch.runtime.zero.stage_1_and_2`, `.monitor.tensorboard`, ...), and the
`deepspeed` compatibility package maps every `deepspeed.X` to `dslaunch.runtime.X`. The runtime
itself is laid out on its own floors (core/, the strategies, train/: docs/architecture.md), so
each such path that is not a file of the runtime is answered here, by a finder that
dslaunch.runtime puts first on sys.meta_path when it is imported:

- `"x.y": "a.b"`: dslaunch.runtime.x.y *is* dslaunch.runtime.a.b, the same module object
  (class identity and module state hold: `isinstance(engine, deepspeed.runtime.engine.
  DeepSpeedEngine)`), and every child dslaunch.runtime.x.y.z is a.b.z;
- `Names(...)`: a DeepSpeed path gathering names that live in several of our modules: a
  module made here that holds exactly those objects (DeepSpeed's `deepspeed.runtime.utils`);
- `Refused(reason)`: a DeepSpeed module dslaunch does not provide: importing it is one
  ImportError line saying why and what to use instead.

The runtime's own former paths (from before the three floors) are entries too, so scripts
written against them keep working. This module imports nothing of dslaunch: the runtime
imports it first.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Dict, Optional, Union

PACKAGE = "dslaunch.runtime"


@dataclass(frozen=True)
class Names:
    """A module made of names found elsewhere: {name: "module" or "module:attribute"}, module
    paths relative to dslaunch.runtime (the attribute defaults to the name)."""

    doc: str
    names: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Refused:
    """A module dslaunch does not provide; `reason` is the whole ImportError message."""

    reason: str


Entry = Union[str, Names, Refused]

# Path under dslaunch.runtime -> where it lives (relative to dslaunch.runtime).
PATHS: Dict[str, Entry] = {
    # -- DeepSpeed's paths whose module lives elsewhere here ------------------------------------
    "accelerator": "core.accelerator",  # deepspeed.accelerator
    "activation_checkpointing": "train.activation_checkpointing",  # deepspeed.runtime.activation_checkpointing
    "checkpoint": "train.checkpoint",  # deepspeed.checkpoint
    "checkpointing": "train.activation_checkpointing.checkpointing",  # deepspeed.checkpointing
    "comm": "core.comm",  # deepspeed.comm
    "compression": "train.compression",  # deepspeed.compression
    "config": "core.config",  # deepspeed.runtime.config
    "dataloader": "train.dataloader",  # deepspeed.runtime.dataloader
    "elasticity": "core.config.elasticity",  # deepspeed.elasticity
    "engine": "train.engine",  # deepspeed.runtime.engine
    "lr_schedules": "train.lr_schedules",  # deepspeed.runtime.lr_schedules
    # DeepSpeed keeps set_autotp_mode in deepspeed.module_inject; only that module's AutoTP mode
    # switch is served (a plain module: deepspeed.module_inject.<anything> is not found)
    "module_inject": "tensor_parallel.mode",
    "monitor": "train.monitor",  # deepspeed.monitor
    "monitor.config": "core.config.monitor",  # deepspeed.monitor.config: the sections live with the config
    "ops": "train.ops",  # deepspeed.ops
    "pipe.engine": "train.pipe_engine",  # deepspeed.runtime.pipe.engine
    "pipe.topology": "topology",  # DeepSpeed's process topology and grid; ours live with the mesh
    "profiling": "train.profiling",  # deepspeed.profiling
    "sequence_parallel.ulysses_sp": "sequence.ulysses_sp",  # deepspeed.runtime.sequence_parallel.ulysses_sp
    "utils.groups": "core.parallel.groups",  # deepspeed.utils.groups: answered by the mesh
    "utils.pin_memory_tracker": "core.accelerator.pin_memory_tracker",  # deepspeed.utils.pin_memory_tracker
    "utils.zero_to_fp32": "train.checkpoint.zero_to_fp32",  # the consolidation script save_checkpoint ships
    # -- the runtime's own former paths (before core/, the strategies and train/) --------------
    "autotuning": "train.autotuning",
    "checkpoint.errors": "core.errors",
    "checkpoint.reshard": "zero.reshard",
    "compiling": "train.compiling",
    "data_parallel": "zero.stage0",
    "inference.plan": "tensor_parallel.plan",
    "inference.structure": "tensor_parallel.structure",
    "internals": "core.internals",
    "loss_scaler": "core.loss_scaler",
    "model_export": "train.model_export",
    "nonfinite": "core.nonfinite",
    "optim": "train.optim",
    "optimizer_policy": "train.optimizer_policy",
    "parallel": "core.parallel",
    "precision": "core.precision",
    "progress": "train.progress",
    "reduction": "core.reduction",
    "sequence_parallel.tiled": "sequence.tiled",
    "strategy": "core.strategy",
    "strict": "core.strict",
    "utils.helpers": "train.helpers",
    "utils.partitioned": "pipe.partitioned",
}


def entry(rel: str) -> Optional[Entry]:
    return PATHS.get(rel)


def is_package(rel: str) -> bool:
    """A Names module with entries below it is a package (its children are found here)."""
    prefix = rel + "."
    return any(key.startswith(prefix) for key in PATHS)


def resolve(rel: str) -> Optional[str]:
    """The real module (full name) that path `rel` under dslaunch.runtime aliases, following
    aliases of its parents; None when the table has no answer (a real file, or nothing)."""
    target = PATHS.get(rel)
    if isinstance(target, str):
        return f"{PACKAGE}.{target}"
    if target is not None:
        return None
    parent, _, leaf = rel.rpartition(".")
    if not parent:
        return None
    base = resolve(parent)
    return f"{base}.{leaf}" if base else None


def _attribute(spec: str, name: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), attr or name)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target
        self.own_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system has just stamped the alias's spec on the module; give the module
        # its own back (its __name__, __file__ and __path__ were never touched).
        module.__spec__ = self.own_spec

    def get_code(self, fullname):
        """`python -m <alias>` runs the real module's code (runpy asks for it)."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _NamesLoader(importlib.abc.Loader):
    def __init__(self, rel: str, names: Names):
        self.rel = rel
        self.names = names

    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module) -> None:
        module.__doc__ = self.names.doc
        for name, where in self.names.names.items():
            setattr(module, name, _attribute(where, name))
        module.__all__ = sorted(self.names.names)


class _RefusingLoader(importlib.abc.Loader):
    def __init__(self, reason: str):
        self.reason = reason

    def create_module(self, spec):
        raise ImportError(self.reason)

    def exec_module(self, module) -> None:  # pragma: no cover - create_module always raises
        raise ImportError(self.reason)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Answers for dslaunch.runtime.<path> names that are entries of PATHS (or children of one)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(PACKAGE + "."):
            return None
        rel = fullname[len(PACKAGE) + 1:]
        found = PATHS.get(rel)
        if isinstance(found, Names):
            return importlib.machinery.ModuleSpec(fullname, _NamesLoader(rel, found), is_package=is_package(rel))
        if isinstance(found, Refused):
            return importlib.machinery.ModuleSpec(fullname, _RefusingLoader(found.reason))
        dest = resolve(rel)
        if dest is None or dest == fullname:
            return None
        try:
            spec = importlib.util.find_spec(dest)
        except ImportError:  # dest's parent is a plain module, or missing
            return None
        if spec is None:
            return None
        # the real file as origin: runpy makes it sys.argv[0] under `python -m <alias>`
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(dest), origin=spec.origin,
                                              is_package=spec.submodule_search_locations is not None)


_FINDER = AliasFinder()


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def top_level(name: str) -> Optional[types.ModuleType]:
    """dslaunch.runtime.<name> for a top-level entry (the runtime's module __getattr__), else None."""
    if name not in PATHS:
        return None
    return importlib.import_module(f"{PACKAGE}.{name}")
