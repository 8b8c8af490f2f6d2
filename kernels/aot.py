"""Ahead-of-time builds of the ops at `pip install` time, as DeepSpeed's DS_BUILD_OPS=1.

    DSLAUNCH_BUILD_OPS=1 pip install --no-build-isolation .        every op this machine can build
    DSLAUNCH_BUILD_OPS=cpu_adam,cpu_lion pip install --no-build-isolation .   only those

setup.py asks `extensions()` for one CppExtension per CPU op (at the instruction set of
the building machine, or DSLAUNCH_CPU_ISA) and a CUDAExtension for the fused Adam where
torch is a CUDA build, built by torch's BuildExtension from the very sources and flags of
the JIT build (builder.py's specs). Each lands in the package as a cache entry:
`dslaunch/kernels/prebuilt/<entry>/<library>` beside a `build.json` holding its sha256,
written by `record()` after the exports are checked. At run time builder.build() finds it
there through the cache's checks before it would compile anything. --no-build-isolation
is needed: the build must see the torch the ops will run with (its version is in the key).

This module is imported by setup.py from the source tree (as `kernels.aot`), before the
package is installed, so it imports only its siblings and torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List

from . import builder
from .cache import Damaged, check_library

ENV = "DSLAUNCH_BUILD_OPS"
_CPU = {"cpu_adam": builder.cpu_adam_spec, "cpu_lion": builder.cpu_lion_spec, "cpu_adagrad": builder.cpu_adagrad_spec,
        "quantizer": builder.quantizer_spec}
_CUDA = {"fused_adam": builder.fused_adam_spec, "quantizer_cuda": builder.quantizer_cuda_spec}
NAMES = (*_CPU, *_CUDA)


class AotError(SystemExit):
    """A bad DSLAUNCH_BUILD_OPS or a library that fails its checks: the build stops with one line."""


def requested(value: str) -> List[str]:
    """The op names DSLAUNCH_BUILD_OPS asks for ("" or "0": none; "1": all)."""
    value = value.strip()
    if value in ("", "0"):
        return []
    if value == "1":
        return list(NAMES)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise AotError(f"{ENV}={value!r}: unknown op {', '.join(unknown)}; expected 1 or a list of "
                       f"{', '.join(NAMES)}")
    return names


def specs(names: List[str]) -> List[builder.OpSpec]:
    """The specs to build; the CUDA one only with a CUDA torch (asked for by name on a CPU
    torch, it is refused rather than silently left out)."""
    import torch

    out = [_CPU[n]() for n in names if n in _CPU]
    for name in (n for n in names if n in _CUDA):
        if torch.version.cuda is not None:
            out.append(_CUDA[name]())
        elif os.environ.get(ENV, "").strip() != "1":
            raise AotError(f"{ENV}: {name} needs a CUDA build of torch; torch {torch.__version__} is CPU-only")
    return out


def _module(spec: builder.OpSpec) -> str:
    return f"dslaunch.kernels.prebuilt.{builder.prebuilt_entry_name(spec)}.{spec.name}"


def extensions() -> Dict[str, builder.OpSpec]:
    """{extension: spec} for DSLAUNCH_BUILD_OPS; setup.py turns them into ext_modules."""
    return {_module(s): s for s in specs(requested(os.environ.get(ENV, "")))}


def make_extension(spec: builder.OpSpec, root: Path):
    """The CppExtension/CUDAExtension of a spec: its sources relative to setup.py, the JIT
    build's flags, and a fixed op namespace of its own (<name>_aot)."""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = [os.path.relpath(s, root) for s in spec.sources]
    cflags = [*spec.cflags, f"-DDS_OPS_NS={spec.name}_aot"]
    kind = CUDAExtension if spec.with_cuda else CppExtension
    args = {"cxx": cflags, "nvcc": list(spec.cuda_cflags)} if spec.with_cuda else cflags
    return kind(name=_module(spec), sources=sources, include_dirs=list(spec.include_dirs), extra_compile_args=args,
                extra_link_args=list(spec.ldflags), py_limited_api=False)


def record(spec: builder.OpSpec, library: Path) -> None:
    """Check a freshly built library's exports and write its build.json beside it."""
    import hashlib

    import torch

    data = library.read_bytes()
    try:
        check_library(library, data, None, spec.symbols)
    except Damaged as e:
        raise AotError(f"{ENV}: building {spec.name} produced a broken library: {e}") from None
    meta = {"name": spec.name, "isa": spec.isa, "torch": torch.__version__, "cflags": list(spec.cflags),
            "cuda_cflags": list(spec.cuda_cflags), "symbols": list(spec.symbols),
            "built_by": "setup.py (torch.utils.cpp_extension.BuildExtension)", "prebuilt": True,
            "library": library.name, "sha256": hashlib.sha256(data).hexdigest()}
    library.chmod(0o755)
    (library.parent / "build.json").write_text(json.dumps(meta, indent=1))
