"""Build the kernels through torch.utils.cpp_extension, cached in the trusted ops cache (cache.py).

CPU ops are built with `torch.utils.cpp_extension.load(...)` (ninja), its build directory
a private work directory inside the cache entry (cache.workdir: mode 0700, inside an entry
this user owns, under the entry's lock), so the cache's ownership, link and checksum rules
cover every file the compiler writes; cpp_extension's own default build directory
(~/.cache/torch_extensions) is never used. Each CPU op is two translation units: the
kernel (cpu_<op>.cpp: no torch header, the SIMD flags of its level) and its torch op
(cpu_<op>_op.cpp: TORCH_LIBRARY through torch's header-light stable API, op_boundary.h),
so a cold build stays a few seconds where <torch/extension.h> alone costs 20.

load() dlopens the fresh library from the work directory (it registers the ops there);
the loader (loader.py) then opens the published file by descriptor and checks its hash, and
the dynamic loader, seeing the same file, hands back the same library. Every build gets a
namespace of its own (-DDS_OPS_NS=<name>_<nonce>, read back from the library): a process
may load two builds of one op (two caches, two instruction sets), and torch allows one
TORCH_LIBRARY per namespace.

The CUDA fused Adam is built the same way, `load(..., with_cuda)`: its kernels
(fused_adam.cu, no torch header) and its torch op (fused_adam_op.cpp, the stable API,
no CUDA header) in one library. That needs a CUDA build of torch; on a CPU-only torch
the build is refused in one line, and CI instead compiles both translation units with
nvcc against torch's headers (`nvcc_check_commands()`, tests/kernels/test_fused_adam.py), links
them and checks the exports, so syntax, symbol and visibility errors still fail there.

Ahead of time (`DSLAUNCH_BUILD_OPS=1 pip install --no-build-isolation .`, aot.py), setup.py
builds the ops with CppExtension/CUDAExtension into the package's prebuilt/ folder, laid out
as a cache entry. `build()` looks there first, through the same OpsCache checks
(ownership, modes, no links, the sha256 in build.json, the exports); a prebuilt op is keyed
like a cache entry except for the compiler (a machine without one must still use it).

A build lands in `<cache>/<name>-<isa>-<key>/`, where the key hashes everything that
changes the binary: the sources and headers, the torch version, the compiler and its
flags, and the instruction set (CPU: a coarse level with fixed flags rather than
-march=native, so one build serves every CPU of that level; CUDA: the GPU architectures).
A fresh library must export the op's C entry points (read from its ELF symbol table)
before it is cached.

Ranks starting together take an flock on `<entry>.lock`: the first builds, the others
wait and then find the finished build. `build.json` is written last, atomically.
"""
from __future__ import annotations

import functools
import hashlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

from .cache import BuildError, Damaged, Entry, OpsCache, check_library, remove_workdir

HERE = Path(__file__).resolve().parent
# Bump when the way a library is produced changes, so that old cache entries are not reused.
BUILD_SCHEME = "cpp-extension-1"

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
ARCH_ENV = "TORCH_CUDA_ARCH_LIST"  # torch's own variable, so one setting serves both
DEFAULT_CUDA_ARCHES = ("9.0",)

PREBUILT_DIR = HERE / "prebuilt"  # where setup.py puts the ops it builds ahead of time (aot.py)
PREBUILT_COMPILER = "prebuilt"  # a prebuilt op's key names no compiler: the machine may have none

__all__ = ["BuildError", "OpSpec", "BuiltOp", "build", "cache_root", "detect_isa", "cpu_flags", "entry_name",
           "prebuilt_entry_name", "cpu_adam_spec", "cpu_lion_spec", "cpu_adagrad_spec", "CPU_OP_SPECS",
           "fused_adam_spec", "nvcc_check_commands", "nvcc_compile_command", "quantizer_spec", "quantizer_cuda_spec"]


@dataclass(frozen=True)
class OpSpec:
    """What to compile: one op, its sources, the flags that shape the binary, and the C
    functions the library must export."""

    name: str
    sources: Tuple[str, ...]
    cflags: Tuple[str, ...] = ()
    ldflags: Tuple[str, ...] = ()
    cuda_cflags: Tuple[str, ...] = ()
    isa: str = "scalar"
    with_cuda: bool = False
    symbols: Tuple[str, ...] = ()
    headers: Tuple[str, ...] = ()  # included files: part of the cache key, not compiled
    include_dirs: Tuple[str, ...] = (str(HERE),)


@dataclass
class BuiltOp:
    name: str
    path: Path  # the shared library
    isa: str
    key: str
    cached: bool  # found in the cache rather than compiled by this call
    seconds: float  # time spent in this call (build or lookup)
    extra: dict = field(default_factory=dict)
    sha256: str = ""
    rebuilt_because: Optional[str] = None  # the damage that made this call rebuild a cached entry


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


def _cxx() -> str:
    return os.environ.get("CXX", "c++")


def _nvcc() -> str:
    explicit = os.environ.get("NVCC")
    if explicit:
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return os.path.join(home, "bin", "nvcc")


@functools.lru_cache(maxsize=None)
def _version_line(cmd: str, last: bool) -> str:
    try:
        out = subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"{cmd}: unavailable"
    lines = out.splitlines() or [""]
    return lines[-1] if last else lines[0]


def _compiler_id(with_cuda: bool) -> str:
    """The compiler's version line: a compiler upgrade must not reuse old objects."""
    ids = [_version_line(_cxx(), False)]
    if with_cuda:
        ids.append(_version_line(_nvcc(), True))
    return " | ".join(ids)


def cache_key(spec: OpSpec, torch_version: str, compiler: str) -> str:
    h = hashlib.sha256(BUILD_SCHEME.encode())
    for src in (*spec.sources, *spec.headers):
        h.update(Path(src).name.encode())
        h.update(Path(src).read_bytes())
    for part in (torch_version, compiler, spec.isa, *spec.cflags, "|", *spec.ldflags, "|", *spec.cuda_cflags):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def entry_name(spec: OpSpec) -> str:
    """The cache entry (directory) name of a spec on this machine: <name>-<isa>-<key>."""
    import torch

    return f"{spec.name}-{spec.isa}-{cache_key(spec, torch.__version__, _compiler_id(spec.with_cuda))}"


def prebuilt_entry_name(spec: OpSpec) -> str:
    """The entry name of a spec's ahead-of-time build: the cache's, with no compiler in the key."""
    import torch

    return f"{spec.name}-{spec.isa}-{cache_key(spec, torch.__version__, PREBUILT_COMPILER)}"


def _torch_includes() -> List[str]:
    from torch.utils import cpp_extension

    return [f for d in cpp_extension.include_paths() for f in ("-isystem", d)]


def _nvcc_source_command(spec: OpSpec, src: Path, obj: Path, werror: bool) -> List[str]:
    """nvcc compiling one source of a CUDA spec with the flags cpp_extension's build adds
    (torch's headers, COMMON_NVCC_FLAGS, -fPIC, its C++ standard) and the spec's own; a
    host-only .cpp goes through nvcc to the host compiler with the spec's cflags."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    strict = ["-Werror", "all-warnings"] if werror else []
    common = [_nvcc(), "-c", str(src), "-o", str(obj), *_torch_includes(), "-std=c++20",
              *(f"-I{d}" for d in spec.include_dirs)]
    if Path(src).suffix == ".cu":
        return [*common, *COMMON_NVCC_FLAGS, "-Xcompiler", "-fPIC", *spec.cuda_cflags, *strict]
    host = ["-fPIC", *spec.cflags, "-DDS_OPS_NS=ds_nvcc_check"] + (["-Wall", "-Werror"] if werror else [])
    return [*common, "-Xcompiler", ",".join(host), *strict]


def nvcc_check_commands(spec: OpSpec, out_dir: Path, werror: bool = True) -> List[List[str]]:
    """The compile-only check of a CUDA spec where torch has no CUDA (CI): nvcc compiles
    every source against torch's headers, then links them into `<out_dir>/<name>.so`
    (torch's symbols left undefined, as in any extension) so that the exports can be
    read. The library is for checking only: it is never cached or loaded."""
    if not spec.with_cuda:
        raise ValueError(f"{spec.name}: a CPU op is built by torch.utils.cpp_extension, not by commands of ours")
    objects, cmds = [], []
    for src in spec.sources:
        obj = Path(out_dir) / (Path(src).name + ".o")
        cmds.append(_nvcc_source_command(spec, Path(src), obj, werror))
        objects.append(str(obj))
    cmds.append([_nvcc(), "-shared", *objects, "-o", str(Path(out_dir) / f"{spec.name}.so"), *spec.ldflags])
    return cmds


def _cpp_extension_build(spec: OpSpec, work: Path, verbose: bool) -> Path:
    """torch.utils.cpp_extension.load() of a spec into `work`; the library's path."""
    from torch.utils import cpp_extension

    namespace = f"{spec.name}_{secrets.token_hex(4)}"  # this build's own torch op namespace
    try:
        path = cpp_extension.load(
            name=spec.name, sources=list(spec.sources), extra_cflags=[*spec.cflags, f"-DDS_OPS_NS={namespace}"],
            extra_cuda_cflags=list(spec.cuda_cflags) or None, extra_ldflags=list(spec.ldflags),
            extra_include_paths=list(spec.include_dirs), build_directory=str(work), with_cuda=spec.with_cuda or None,
            is_python_module=False, verbose=verbose)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        detail = str(e).strip() or type(e).__name__
        nvcc = f", NVCC={_nvcc()}" if spec.with_cuda else ""
        raise BuildError(f"building {spec.name} ({spec.isa}) failed through torch.utils.cpp_extension "
                         f"(CXX={_cxx()}{nvcc}, build directory {work}):\n{detail}") from None
    return Path(path)


def _compile(spec: OpSpec, cache: OpsCache, entry: str, torch_version: str, compiler: str,
             verbose: bool) -> Entry:
    """Compile in a private work directory, check the exports, then publish."""
    work = cache.workdir(entry)
    try:
        t0 = time.perf_counter()
        lib = _cpp_extension_build(spec, work, verbose)
        if lib.parent != work:
            raise BuildError(f"building {spec.name}: cpp_extension wrote {lib} outside {work}")
        how = f"torch.utils.cpp_extension.load (commands: {work / 'build.ninja'})"
        try:
            check_library(cache.root / entry / lib.name, lib.read_bytes(), None, spec.symbols)
        except Damaged as e:
            raise BuildError(f"building {spec.name} ({spec.isa}) produced a broken library: {e}; "
                             f"built by: {how}") from None
        meta = {"name": spec.name, "isa": spec.isa, "torch": torch_version, "compiler": compiler,
                "cflags": list(spec.cflags), "cuda_cflags": list(spec.cuda_cflags), "symbols": list(spec.symbols),
                "built_by": "torch.utils.cpp_extension",
                "build_seconds": round(time.perf_counter() - t0, 2)}
        return cache.publish(entry, work, lib.name, meta)
    finally:
        remove_workdir(work)


def build(spec: OpSpec, root: Optional[Path] = None, verbose: bool = False) -> BuiltOp:
    """Return the op's verified shared library, compiling it first unless the cache has it.

    A cached library that is damaged (its sha256 differs from build.json, it is no ELF
    library, or it lacks an entry point) is rebuilt once, with one line on stderr. Raises
    BuildError: an untrusted cache (one line naming the path and why), a compiler failure
    (its output and command), or a library that is broken again after the rebuild.
    """
    t0 = time.perf_counter()
    import torch

    prebuilt = _prebuilt(spec)
    if prebuilt is not None:
        return _built(spec, prebuilt.path.parent.name.rsplit("-", 1)[1], prebuilt, True, t0)
    if spec.with_cuda and torch.version.cuda is None:  # refused before the cache is touched
        raise BuildError(f"building {spec.name} needs a CUDA build of torch; torch {torch.__version__} is CPU-only "
                         "(`dslaunch build-ops --no-cuda` builds the CPU ops)")
    compiler = _compiler_id(spec.with_cuda)
    entry = entry_name(spec)
    key = entry.rsplit("-", 1)[1]
    root = Path(root) if root is not None else cache_root()
    with OpsCache(root) as cache:
        try:
            found = cache.lookup(entry, spec.symbols)
            if found is not None:
                return _built(spec, key, found, True, t0)
        except Damaged:
            pass  # looked at again under the lock: another rank may be repairing it
        damage = None
        try:
            with cache.lock(entry):
                try:
                    found = cache.lookup(entry, spec.symbols)
                    if found is not None:
                        return _built(spec, key, found, True, t0)
                except Damaged as e:
                    damage = str(e)
                    print(f"dslaunch: rebuilding {spec.name}: {damage}", file=sys.stderr)
                    cache.invalidate(entry)
                try:
                    found = _compile(spec, cache, entry, torch.__version__, compiler, verbose)
                except BuildError as e:
                    if damage is not None:
                        raise BuildError(f"{damage}; rebuilding it failed: {e}") from None
                    raise
        except OSError as e:
            raise BuildError(f"ops cache: cannot build in {root / entry}: {e.strerror or e}") from None
        built = _built(spec, key, found, False, t0)
        built.rebuilt_because = damage
        return built


def _prebuilt(spec: OpSpec) -> Optional[Entry]:
    """The op as built at install time (aot.py), checked as a cache entry is; None when the
    package has none for this spec (not built ahead of time, another torch or instruction
    set, changed sources). A damaged one is said once and built instead; an untrusted one
    (another owner, writable by others, a link) is refused, as in the cache."""
    entry = prebuilt_entry_name(spec)
    if not os.path.isdir(PREBUILT_DIR / entry):
        return None
    with OpsCache(PREBUILT_DIR) as prebuilt:
        try:
            return prebuilt.lookup(entry, spec.symbols)
        except Damaged as e:
            print(f"dslaunch: not using the prebuilt {spec.name}, building it: {e}", file=sys.stderr)
            return None


def _built(spec: OpSpec, key: str, found: Entry, cached: bool, t0: float) -> BuiltOp:
    return BuiltOp(spec.name, found.path, spec.isa, key, cached, time.perf_counter() - t0, found.meta, found.sha256)


# -- the ops ----------------------------------------------------------------------------


def cpu_op_spec(name: str, source: str, symbols: Tuple[str, ...], isa: Optional[str] = None,
                op_source: Optional[str] = None) -> OpSpec:
    """A CPU SIMD op at an instruction-set level (default: the best this CPU runs); `source`
    is a file name in this package or a path (the benchmark's bandwidth probe); `op_source`
    the translation unit that registers it as a torch op, if it has one."""
    isa = isa or detect_isa()
    sources = (source,) if op_source is None else (source, op_source)
    headers = ("cpu_simd.h",) if op_source is None else ("cpu_simd.h", "cpu_hyper.h", "op_boundary.h", "op_common.h")
    return OpSpec(
        name=f"{name}_{isa}",
        sources=tuple(str(HERE / s) for s in sources),  # an absolute `source` stays as it is
        # -ffp-contract=off: the compiler may not fuse a*b+c on its own, so every instruction
        # set computes exactly the operations written (explicit fma()s) and gives the same bits.
        cflags=("-O3", "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off", *ISA_CFLAGS[isa]),
        ldflags=("-fopenmp",),
        isa=isa,
        symbols=symbols,
        headers=tuple(str(HERE / h) for h in headers),
    )


def cpu_adam_spec(isa: Optional[str] = None) -> OpSpec:
    return cpu_op_spec("ds_cpu_adam", "cpu_adam.cpp",
                       ("ds_cpu_adam_step", "ds_cpu_adam_isa", "ds_cpu_adam_namespace"), isa, "cpu_adam_op.cpp")


def cpu_lion_spec(isa: Optional[str] = None) -> OpSpec:
    return cpu_op_spec("ds_cpu_lion", "cpu_lion.cpp",
                       ("ds_cpu_lion_step", "ds_cpu_lion_isa", "ds_cpu_lion_namespace"), isa, "cpu_lion_op.cpp")


def cpu_adagrad_spec(isa: Optional[str] = None) -> OpSpec:
    return cpu_op_spec("ds_cpu_adagrad", "cpu_adagrad.cpp",
                       ("ds_cpu_adagrad_step", "ds_cpu_adagrad_isa", "ds_cpu_adagrad_namespace"), isa,
                       "cpu_adagrad_op.cpp")


def quantizer_spec(isa: Optional[str] = None) -> OpSpec:
    """ZeRO++'s block quantizer (quantizer.cpp + quantizer_op.cpp; the maths in quantize_ref.py)."""
    return cpu_op_spec("ds_quant", "quantizer.cpp", ("ds_quantize", "ds_dequantize", "ds_quant_isa",
                                                     "ds_quant_namespace"), isa, "quantizer_op.cpp")


CPU_OP_SPECS = (cpu_adam_spec, cpu_lion_spec, cpu_adagrad_spec, quantizer_spec)  # what `dslaunch build-ops` builds


def _arch_list() -> List[str]:
    """GPU architectures ("9.0", "8.6+PTX", ...): TORCH_CUDA_ARCH_LIST as torch reads it,
    else the visible devices' capabilities, else DEFAULT_CUDA_ARCHES (a machine without a GPU)."""
    text = os.environ.get(ARCH_ENV, "").strip()
    if text and text != "native":
        arches = [a for a in text.replace(";", " ").replace(",", " ").split() if a]
        for a in arches:
            base = a[:-4] if a.endswith("+PTX") else a
            if not base.replace(".", "", 1).rstrip("a").isdigit() or "." not in base:
                raise ValueError(f"{ARCH_ENV}={text!r}: {a!r} is not an architecture like 9.0 or 8.6+PTX")
        return arches
    try:
        import torch

        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    except Exception:  # no CUDA runtime: compile for the default
        caps = []
    return [f"{a}.{b}" for a, b in caps] or list(DEFAULT_CUDA_ARCHES)


def _gencode(arches: List[str]) -> List[str]:
    flags = []
    for i, a in enumerate(arches):
        base = a[:-4] if a.endswith("+PTX") else a
        num = base.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if a.endswith("+PTX") or i == len(arches) - 1:  # PTX of the newest: runs on later GPUs too
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def fused_adam_spec(arches: Optional[List[str]] = None) -> OpSpec:
    """The CUDA fused Adam: its kernels (fused_adam.cu) and its torch op (fused_adam_op.cpp).
    cpp_extension adds torch's own nvcc flags (COMMON_NVCC_FLAGS: no half operators, as
    torch's ops), -fPIC and the C++ standard; the -gencode flags below replace its
    architecture detection."""
    arches = list(arches) if arches else _arch_list()
    return OpSpec(
        name="ds_fused_adam",
        sources=(str(HERE / "fused_adam.cu"), str(HERE / "fused_adam_op.cpp")),
        cflags=("-O3", "-fvisibility=hidden"),
        cuda_cflags=("-O3", "-Xcompiler", "-Wall,-fvisibility=hidden", *_gencode(arches)),
        isa="cuda-" + "-".join(a.replace(".", "").replace("+PTX", "p") for a in arches),
        with_cuda=True,
        symbols=("ds_fused_adam_step", "ds_fused_nonfinite", "ds_fused_upload", "ds_fused_adam_error_string",
                 "ds_fused_adam_namespace"),
        headers=tuple(str(HERE / h) for h in ("op_common.h",)),
    )


def quantizer_cuda_spec(arches: Optional[List[str]] = None) -> OpSpec:
    """ZeRO++'s block quantizer on CUDA: its kernels (quantizer.cu) and torch op
    (quantizer_cuda_op.cpp), built like the fused Adam (fused_adam_spec)."""
    arches = list(arches) if arches else _arch_list()
    return OpSpec(
        name="ds_quant_cuda",
        sources=(str(HERE / "quantizer.cu"), str(HERE / "quantizer_cuda_op.cpp")),
        cflags=("-O3", "-fvisibility=hidden"),
        cuda_cflags=("-O3", "-Xcompiler", "-Wall,-fvisibility=hidden", *_gencode(arches)),
        isa="cuda-" + "-".join(a.replace(".", "").replace("+PTX", "p") for a in arches),
        with_cuda=True,
        symbols=("ds_quant_cuda_quantize", "ds_quant_cuda_dequantize", "ds_quant_cuda_error_string",
                 "ds_quant_cuda_namespace"),
        headers=tuple(str(HERE / h) for h in ("op_common.h",)),
    )


def nvcc_compile_command(out_obj: Path, arch: str = "sm_90", spec: Optional[OpSpec] = None,
                         source: Optional[Path] = None, werror: bool = False) -> List[str]:
    """The nvcc line that compiles one source of `spec` (default: fused_adam.cu for `arch`)
    to an object with the flags of the cpp_extension build. `werror=True` (CI) also turns
    every warning into an error; a user's build does not, so a newer nvcc's new warning
    costs nobody their kernel."""
    if spec is None:
        num = arch[3:] if arch.startswith("sm_") else arch.replace(".", "")
        spec = fused_adam_spec([f"{num[:-1]}.{num[-1]}"])
    return _nvcc_source_command(spec, Path(source or spec.sources[0]), Path(out_obj), werror)
