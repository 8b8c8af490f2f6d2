"""Checkpoint file I/O: atomic writes with a checksum, safe reads, OS errors as one line.

Writing: every file goes to NAME.part through a writer that feeds each chunk to XXH3-64
as torch.save emits it, so the checksum costs no second pass over the data; then fsync
and os.replace. XXH3 (the xxhash package) rather than zlib's CRC-32: on this project's
machine it hashes about 11 GB/s against CRC-32's 2 GB/s, which made verification most of
a load's time (scripts/bench_checkpoint.py measures both; see docs/benchmarks.md). Any OSError (a full disk, a read-only or vanished directory) becomes
a CheckpointError naming the file and the OS error, and the .part file is removed.

Reading: torch.load(weights_only=True) always: tensors, containers, numbers and strings
are rebuilt and nothing else is (no pickled object can run code while loading); the few
classes DeepSpeed pickles are rebuilt as inert stand-ins (foreign.py). `trust_pickle=True`
is the documented escape hatch for a checkpoint whose client_state was saved with
allow_pickle=True (or holds a script's own objects), and only for sources the user trusts.
"""
from __future__ import annotations

import mmap
import os
import shutil
import stat
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ...core.errors import CheckpointError

CHECKSUM = "xxh3_64"  # the manifest names the algorithm
_CHUNK = 8 << 20


@dataclass(frozen=True)
class FileRecord:
    """What the manifest keeps per file."""

    size: int
    digest: str  # hex digest of CHECKSUM


def new_checksum():
    """An XXH3-64 hasher. xxhash is imported here, not with the package, so that
    `import dslaunch.runtime` works where it is missing (a bare image): only writing or
    verifying a dslaunch checkpoint needs it, and then the error says so in one line."""
    try:
        import xxhash
    except ImportError:
        raise CheckpointError(f"checkpoint checksums ({CHECKSUM}) need the xxhash package, which is not installed "
                              "here: pip install 'xxhash>=3.0' (a declared dependency of dslaunch)") from None
    return xxhash.xxh3_64()


def os_error(path: str, exc: OSError, doing: str = "cannot write") -> CheckpointError:
    reason = exc.strerror or str(exc)
    return CheckpointError(f"{doing} {path}: {reason}")


class _ChecksumWriter:
    """The file object torch.save writes to: counts and checksums every chunk and keeps
    the OSError a failed write raised (torch reports it as an opaque 'unexpected pos')."""

    def __init__(self, fh, hasher):
        self.fh, self.size, self.hash, self.error = fh, 0, hasher, None

    def write(self, data) -> int:
        try:
            n = self.fh.write(data)
        except OSError as exc:
            self.error = exc
            raise
        if self.hash is not None:
            self.hash.update(data)
        self.size += len(data)
        return n

    def flush(self) -> None:
        self.fh.flush()


def _write_atomic(path: str, emit: Callable[[_ChecksumWriter], None], checksum: bool = True) -> FileRecord:
    """checksum=False: a file no manifest lists (a consolidated state_dict); digest left empty."""
    part = path + ".part"
    writer, hasher = None, new_checksum() if checksum else None
    try:
        with open(part, "wb") as fh:
            writer = _ChecksumWriter(fh, hasher)
            emit(writer)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(part, path)
    except OSError as exc:
        _remove(part)
        raise os_error(path, exc) from None
    except BaseException as exc:
        _remove(part)
        if writer is not None and writer.error is not None:
            raise os_error(path, writer.error) from None
        if isinstance(exc, RuntimeError) and not isinstance(exc, CheckpointError):
            raise CheckpointError(f"cannot write {path}: {str(exc).splitlines()[0]}") from None
        raise
    return FileRecord(writer.size, hasher.hexdigest() if hasher is not None else "")


def write_torch(path: str, obj: Any, deepspeed_objects: bool = False, checksum: bool = True) -> FileRecord:
    """deepspeed_objects: obj holds foreign.py stand-ins to be pickled as DeepSpeed's classes."""
    if deepspeed_objects:
        from .foreign import save_with_deepspeed_globals

        return _write_atomic(path, lambda w: save_with_deepspeed_globals(obj, w), checksum)
    return _write_atomic(path, lambda w: torch.save(obj, w), checksum)


def write_bytes(path: str, data: bytes) -> FileRecord:
    return _write_atomic(path, lambda w: w.write(data))


def file_record(path: str) -> FileRecord:
    """Size and checksum of a file as it is on disk: hashed straight from a read-only
    memory map, so the bytes are not copied through Python buffers first."""
    h = new_checksum()
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size:
                with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
                    h.update(view)
    except OSError as exc:
        raise os_error(path, exc, "cannot read") from None
    return FileRecord(size, h.hexdigest())


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def ensure_writable_dir(path: str) -> None:
    """Create `path` if needed and prove a file can be created in it, before any work is
    spent on a save (permission bits alone say nothing for root or read-only mounts)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise os_error(path, exc, "cannot create checkpoint directory") from None
    if not os.path.isdir(path):
        raise CheckpointError(f"cannot save checkpoint: {path} is not a directory")
    probe = os.path.join(path, f".write-test.{os.getpid()}")
    try:
        with open(probe, "wb") as fh:
            fh.write(b"x")
    except OSError as exc:
        _remove(probe)
        raise os_error(path, exc, "cannot write to checkpoint directory") from None
    _remove(probe)


def _forbidden_globals(path: str) -> list:
    """The pickled callables that made weights_only refuse the file (not the allowed
    stand-ins); empty when its pickle does not even parse (garbage, not a payload)."""
    from .foreign import read_globals

    allowed = {g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}" for g in read_globals()}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        return []
    return sorted(n for n in found if n not in allowed and all(p.isidentifier() for p in n.split(".")))


def _weights_only_reason(exc: Exception) -> str:
    """torch's own reason inside its long weights_only message ("Unsupported operand 127")."""
    after = str(exc).partition("WeightsUnpickler error:")[2]
    reason = next((line.strip() for line in after.splitlines() if line.strip()), "")
    reason = reason.split(" Please use")[0][:200]  # torch's advice on allowlisting is no reason
    return reason if reason and not reason.startswith("Check the documentation") else type(exc).__name__


def _refusal(path: str, exc: Exception) -> CheckpointError:
    """weights_only refused the file: a real pickle payload (it names callables to run) is
    told apart from damage (bytes that are no valid pickle), which trust_pickle cannot mend."""
    names = _forbidden_globals(path)
    if names:
        return CheckpointError(
            f"checkpoint file {path} holds pickled Python objects ({', '.join(names[:3])}) that could run "
            "code when loaded; refused. If you trust its source, pass trust_pickle=True")
    return CheckpointError(f"checkpoint file {path} is damaged or truncated: its pickled data is not valid "
                           f"({_weights_only_reason(exc)}); restore the file from a good copy")


def load_torch(path: str, *, mmap: bool = False, trust_pickle: bool = False, within: Optional[str] = None) -> Any:
    """torch.load with weights_only=True (or the explicit trust_pickle opt-in); every
    failure is one CheckpointError line naming the file. `within`: the checkpoint folder
    the file must lie in once links are resolved (a link out of it is refused)."""
    from .foreign import deepspeed_globals, load_trusting

    if not os.path.lexists(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    if within is not None:
        check_inside(path, within)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise os_error(path, exc, "cannot read checkpoint file") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"checkpoint file {path} is not a regular file; refusing to read it")
    try:
        if trust_pickle:
            return load_trusting(path, mmap=mmap)
        with deepspeed_globals():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError as exc:
        raise os_error(path, exc, "cannot read checkpoint file") from None
    except Exception as exc:
        if type(exc).__name__ == "UnpicklingError" and "weights_only" in str(exc):
            raise _refusal(path, exc) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint file {path} cannot be read: {first}") from None


def check_inside(path: str, folder: str) -> None:
    """Refuse `path` when it resolves (links followed) outside `folder` (resolved too): a
    file or subfolder of a checkpoint linked elsewhere would load someone else's data."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, root]) != root:
        raise CheckpointError(f"checkpoint file {path} resolves to {real}, outside the checkpoint {root} (a link "
                              "out of it); refusing to read it")


# -- what may go into a file that weights_only=True reads back ------------------------------
_SCALARS = (str, bytes, bytearray, int, float, bool, complex, type(None), torch.dtype, torch.device)


def plain_value_problem(value: Any, where: str, depth: int = 0) -> Optional[str]:
    """None when `value` (recursively) is tensors, containers, numbers and strings only,
    i.e. it loads under weights_only=True; else the first offending key path and type."""
    if depth > 100:
        return f"{where}: nested more than 100 levels deep"
    if isinstance(value, _SCALARS) and type(value) in _SCALARS + (bool,):
        return None
    if isinstance(value, torch.Size):
        return None
    if torch.is_tensor(value):
        if type(value) in (torch.Tensor, torch.nn.Parameter):
            return None
        return f"{where}: tensor subclass {type(value).__module__}.{type(value).__qualname__}"
    if type(value) in (list, tuple, set):
        for i, v in enumerate(value):
            problem = plain_value_problem(v, f"{where}[{i}]", depth + 1)
            if problem:
                return problem
        return None
    if type(value) in (dict, OrderedDict, Counter):  # what torch's weights_only unpickler rebuilds
        for k, v in value.items():
            problem = plain_value_problem(k, f"{where} key {k!r}", depth + 1) or \
                plain_value_problem(v, f"{where}[{k!r}]", depth + 1)
            if problem:
                return problem
        return None
    t = type(value)
    return f"{where}: {t.__module__}.{t.__qualname__} is not a tensor, number, string or container of those"
