"""JIT build of the kernels through torch.utils.cpp_extension, cached and lock-protected.

A build lands in `<cache>/<name>-<isa>-<key>/`, where the key hashes everything that
changes the binary: the sources, the torch version, the compiler and its flags, and the
CPU instruction set the code is compiled for. The instruction set is a coarse level
(avx512, avx2, scalar) with fixed flags rather than -march=native, so one build serves
every CPU of that level, and a cache shared between machines never hands an AVX-512
binary to a CPU without AVX-512.

Ranks starting together take an flock on `<dir>.lock`: the first builds, the others
block on the lock and then find the finished build. An flock dies with its process, so
a builder killed half-way leaves no stale lock behind (torch's own baton file would).
A build is complete only once `build.json` exists; it is written last, atomically.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

HERE = Path(__file__).resolve().parent

ISA_LEVELS = ("avx512", "avx2", "scalar")
# Fixed per level, never -march=native: the binary must run on every CPU of its level.
ISA_CFLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}
_ISA_NEEDS = {
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"},
    "avx2": {"avx2", "fma", "f16c"},
    "scalar": set(),
}
ISA_ENV = "DSLAUNCH_CPU_ISA"
CACHE_ENV = "DSLAUNCH_OPS_CACHE"


class BuildError(RuntimeError):
    """A kernel failed to compile; the message carries the compiler's own output and command."""


@dataclass(frozen=True)
class OpSpec:
    """What to compile: one op, its sources and the flags that shape the binary."""

    name: str
    sources: Tuple[str, ...]
    cflags: Tuple[str, ...] = ()
    ldflags: Tuple[str, ...] = ()
    cuda_cflags: Tuple[str, ...] = ()
    isa: str = "scalar"
    with_cuda: bool = False


@dataclass
class BuiltOp:
    name: str
    path: Path  # the shared library
    isa: str
    key: str
    cached: bool  # found in the cache rather than compiled by this call
    seconds: float  # time spent in this call (build or lookup)
    extra: dict = field(default_factory=dict)


def cpu_flags() -> set:
    """The CPU feature flags of this machine (Linux /proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_isa() -> str:
    """The best level this CPU runs, or the level forced through DSLAUNCH_CPU_ISA.

    Forcing a level the CPU lacks is refused: the binary would die with SIGILL.
    """
    flags = cpu_flags()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISA_LEVELS:
            raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(ISA_LEVELS)}")
        missing = _ISA_NEEDS[forced] - flags
        if missing:
            raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(sorted(missing))}")
        return forced
    for level in ISA_LEVELS:
        if _ISA_NEEDS[level] <= flags:
            return level
    return "scalar"


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dslaunch" / "ops"


def _compiler_id(with_cuda: bool) -> str:
    """The compiler's version line: a compiler upgrade must not reuse old objects."""
    ids = []
    cxx = os.environ.get("CXX", "c++")
    cmds = [[cxx, "--version"]] + ([["nvcc", "--version"]] if with_cuda else [])
    for cmd in cmds:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
            ids.append(out.strip().splitlines()[-1] if cmd[0] == "nvcc" and out.strip() else out.split("\n", 1)[0])
        except (OSError, subprocess.SubprocessError):
            ids.append(f"{cmd[0]}: unavailable")
    return " | ".join(ids)


def cache_key(spec: OpSpec, torch_version: str, compiler: str) -> str:
    h = hashlib.sha256()
    for src in spec.sources:
        h.update(Path(src).name.encode())
        h.update(Path(src).read_bytes())
    for part in (torch_version, compiler, spec.isa, *spec.cflags, "|", *spec.ldflags, "|", *spec.cuda_cflags):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class _FileLock:
    """Exclusive flock on a file; says once on stderr that it waits for another builder."""

    def __init__(self, path: Path, what: str):
        self.path, self.what, self.fd = path, what, -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"dslaunch: waiting for another process building {self.what} ({self.path})", file=sys.stderr)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _ninja_on_path(env_path: str) -> str:
    """torch's builder runs `ninja` from PATH; the pip ninja lives next to our interpreter."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the pip package ships the binary

        dirs.append(getattr(ninja, "BIN_DIR", ""))
    except ImportError:
        pass
    return os.pathsep.join([d for d in dirs if d] + [env_path])


def _build_error(spec: OpSpec, build_dir: Path, raw: str) -> BuildError:
    """Turn torch's "Error building extension" into the compiler's output plus the command."""
    text = raw.split(":", 1)[1].strip() if raw.startswith("Error building extension") and ":" in raw else raw
    command = ""
    ninja_file = build_dir / "build.ninja"
    if ninja_file.exists():
        rules = [ln.strip() for ln in ninja_file.read_text().splitlines() if ln.strip().startswith("command =")]
        command = "\n".join(r.split("=", 1)[1].strip() for r in rules)
    msg = f"building {spec.name} ({spec.isa}) failed in {build_dir}:\n{text}"
    if command and "command" not in text.lower():
        msg += f"\ncompiler commands (from build.ninja):\n{command}"
    return BuildError(msg)


def build(spec: OpSpec, root: Optional[Path] = None, verbose: bool = False) -> BuiltOp:
    """Return the op's shared library, compiling it first unless the cache has it."""
    t0 = time.perf_counter()
    root = Path(root) if root is not None else cache_root()
    import torch

    key = cache_key(spec, torch.__version__, _compiler_id(spec.with_cuda))
    build_dir = root / f"{spec.name}-{spec.isa}-{key}"
    lib = build_dir / f"{spec.name}.so"
    record = build_dir / "build.json"

    def finished() -> Optional[BuiltOp]:
        if record.exists():
            meta = json.loads(record.read_text())
            found = build_dir / meta.get("library", lib.name)
            if found.exists():
                return BuiltOp(spec.name, found, spec.isa, key, True, time.perf_counter() - t0, meta)
        return None

    done = finished()
    if done is not None:
        return done
    root.mkdir(parents=True, exist_ok=True)
    with _FileLock(root / f"{build_dir.name}.lock", spec.name):
        done = finished()
        if done is not None:
            return done
        build_dir.mkdir(exist_ok=True)
        # torch's own baton; one left by a builder killed half-way would block load() forever.
        # Holding our flock means nobody else is building here, so it can only be stale.
        (build_dir / "lock").unlink(missing_ok=True)
        from torch.utils import cpp_extension

        old_path = os.environ.get("PATH", "")
        os.environ["PATH"] = _ninja_on_path(old_path)
        t_build = time.perf_counter()
        try:
            # The returned path is the library's: torch renames it (name_v1.so, ...) when one
            # process builds the same name twice with different sources, flags or directories.
            out = cpp_extension.load(
                name=spec.name,
                sources=list(spec.sources),
                extra_cflags=list(spec.cflags),
                extra_cuda_cflags=list(spec.cuda_cflags) or None,
                extra_ldflags=list(spec.ldflags),
                build_directory=str(build_dir),
                verbose=verbose,
                with_cuda=spec.with_cuda,
                is_python_module=False,
            )
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            raise _build_error(spec, build_dir, str(e)) from None
        finally:
            os.environ["PATH"] = old_path
        lib = Path(out)
        meta = {
            "name": spec.name,
            "library": lib.name,
            "isa": spec.isa,
            "torch": torch.__version__,
            "cflags": list(spec.cflags),
            "build_seconds": round(time.perf_counter() - t_build, 2),
        }
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, record)
    return BuiltOp(spec.name, lib, spec.isa, key, False, time.perf_counter() - t0, meta)


def cpu_adam_spec(isa: Optional[str] = None) -> OpSpec:
    isa = isa or detect_isa()
    return OpSpec(
        name=f"ds_cpu_adam_{isa}",
        sources=(str(HERE / "cpu_adam.cpp"),),
        cflags=("-O3", "-fopenmp", *ISA_CFLAGS[isa]),
        ldflags=("-fopenmp",),
        isa=isa,
    )


def fused_adam_spec() -> OpSpec:
    return OpSpec(
        name="ds_fused_adam",
        sources=(str(HERE / "fused_adam.cu"),),
        cflags=("-O3",),
        cuda_cflags=("-O3", "-std=c++17"),
        isa="cuda",
        with_cuda=True,
    )


def nvcc_compile_command(out_obj: Path, arch: str = "sm_90") -> List[str]:
    """The nvcc line that compiles fused_adam.cu to an object with the flags torch's CUDA
    builds add (no half operators/conversions, relaxed constexpr) and warnings as errors:
    runs on a machine without a GPU (CI), so a syntax or type error cannot land unseen."""
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS as torch_flags
    except ImportError:
        torch_flags = []
    return [
        os.environ.get("NVCC", "nvcc"),
        "-c", str(HERE / "fused_adam.cu"), "-o", str(out_obj),
        *torch_flags, *fused_adam_spec().cuda_cflags,
        "-Xcompiler", "-fPIC,-Wall", "-Werror", "all-warnings",
        f"-gencode=arch=compute_{arch[3:]},code={arch}",
    ]
