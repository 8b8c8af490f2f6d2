"""Load a built op into the process, once, and remember why it is unusable if it is.

`LazyOp` is what the optimizers hold: `load()` builds or finds the library (builder.py),
opens it without following links, re-hashes the open descriptor against build.json and
dlopens that very descriptor (/proc/self/fd/N), so the code that runs is the code that was
checked. The descriptor stays open for the life of the process: the library is never
unloaded, and a reused descriptor number must never alias another library's name in the
dynamic loader.

Any failure (untrusted cache, compiler error, damaged library that a rebuild did not fix,
dlopen error) leaves `error` set to the exact reason; `warn_fallback()` then says it once.
"""
from __future__ import annotations

import ctypes
import os
import threading
import warnings
from typing import Callable, Optional

from . import builder
from .cache import BuildError, Damaged, Entry, OpsCache


def _dlopen(built: builder.BuiltOp) -> ctypes.CDLL:
    with OpsCache(built.path.parent.parent) as cache:  # <root>/<entry>/<lib>
        fd = cache.open_library(Entry(built.path, built.extra, built.sha256))
    proc_path = f"/proc/self/fd/{fd}"
    try:
        return ctypes.CDLL(proc_path if os.path.exists(proc_path) else str(built.path))
    except OSError as e:
        os.close(fd)
        raise BuildError(f"{built.path}: cannot be loaded: {str(e).replace(proc_path, str(built.path))}") from None


def load_library(spec: builder.OpSpec, root=None) -> "tuple[ctypes.CDLL, builder.BuiltOp]":
    """Build (or find) the op and dlopen it. A library that changes between the check and
    the load (a concurrent repair) is looked up once more; a second failure is final."""
    for attempt in (1, 2):
        built = builder.build(spec, root)
        try:
            lib = _dlopen(built)
        except Damaged as e:
            if attempt == 2:
                raise BuildError(str(e)) from None
            continue
        missing = [s for s in spec.symbols if not hasattr(lib, s)]
        if missing:  # the ELF check passed, so this is the dynamic loader disagreeing: say so
            raise BuildError(f"{built.path}: the loaded library lacks {', '.join(missing)}")
        return lib, built
    raise AssertionError("unreachable")


class LazyOp:
    """One compiled op, built and loaded on first use.

    spec: makes the OpSpec (called at load time, so the ISA/arch is detected then).
    bind: declares the ctypes signatures on the loaded library; what it returns (the
    library's torch op, for ops registered through TORCH_LIBRARY) becomes `torch_op`.
    """

    def __init__(self, what: str, spec: Callable[[], builder.OpSpec], bind: Callable[[ctypes.CDLL], None],
                 precondition: Optional[Callable[[], Optional[str]]] = None):
        self.what = what
        self._spec, self._bind, self._precondition = spec, bind, precondition
        self.lib: Optional[ctypes.CDLL] = None
        self.built: Optional[builder.BuiltOp] = None
        self.torch_op = None
        self.error: Optional[str] = None
        self.tried = False
        self.settled = False  # tried, and the outcome (lib or error) is final
        self.warned = False
        self.lock = threading.Lock()

    def load(self) -> bool:
        """True when the op is usable; the first call builds or loads it."""
        if self.settled:  # no lock once settled: torch.compile traces this without a graph break
            return self.lib is not None
        with self.lock:
            if not self.tried:
                self.tried = True
                try:
                    reason = self._precondition() if self._precondition else None
                    if reason:
                        self.error = reason
                        self.settled = True
                        return False
                    lib, built = load_library(self._spec())
                    self.torch_op = self._bind(lib)
                    self.lib, self.built = lib, built
                except (BuildError, ValueError, OSError) as e:
                    self.error = str(e)
                except Exception as e:  # a bug of ours must still say what happened, never "None"
                    self.error = f"{type(e).__name__}: {e}"
                self.settled = True
            return self.lib is not None

    def warn_fallback(self, fallback: str, stacklevel: int = 4) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(f"dslaunch {self.what} op is unavailable, falling back to {fallback}. "
                          f"Cause:\n{self.error}", RuntimeWarning, stacklevel=stacklevel)
