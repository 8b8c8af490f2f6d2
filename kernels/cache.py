"""The ops cache on disk: compiled kernels that this process will dlopen and run.

Whoever can write a file in it can run code as every user of it, so:

* the cache directory, each entry directory, the lock files, `build.json` and the
  library must belong to this user (or root) and must not be group- or world-writable;
  anything else is refused with one line naming the path and why;
* nothing is reached through a symbolic link: the root is opened with O_NOFOLLOW and
  everything below it relative to that descriptor (openat-style, `dir_fd=`), with
  O_NOFOLLOW/O_EXCL on every open and lstat-style checks on what is found;
* `build.json` records the library's sha256; a stored library is hashed from the very
  descriptor that is then dlopen'ed (/proc/self/fd/N), so what runs is what was checked.

A library whose hash or exported symbols do not match is *damaged* (a truncated file, a
bad build), not refused: the builder rebuilds it once under the entry's lock.

Layout: <root>/<entry>.lock (flock), <root>/<entry>/{<name>.so, build.json}; builds run in
<root>/<entry>/.build-<pid>-<rand>/ and are renamed into place, `build.json` last.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pwd
import secrets
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional

from .elf import ElfError, exported_functions

RECORD = "build.json"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class BuildError(RuntimeError):
    """An op cannot be built, trusted or loaded. The first line names the path and why;
    a compiler failure appends the compiler's own output and command."""


class Damaged(Exception):
    """A cache entry that is ours but broken (hash or symbols); the builder rebuilds it once."""


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _why_untrusted(st: os.stat_result, kind: str) -> Optional[str]:
    """Why a file or directory found in the cache must not be used, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link; refusing to follow it (dslaunch never makes one there: remove it)"
    want_dir = kind == "dir"
    if want_dir != stat.S_ISDIR(st.st_mode) or (not want_dir and not stat.S_ISREG(st.st_mode)):
        return f"is not a {'directory' if want_dir else 'regular file'}"
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"is owned by {_user(st.st_uid)}, not by this user ({_user(me)}); refusing to use it"
    if st.st_mode & 0o022:
        who = "world" if st.st_mode & 0o002 else "group"
        return (f"is {who}-writable (mode {stat.S_IMODE(st.st_mode):o}), so others could plant code in it; "
                f"refusing to use it")
    return None


def _refused(path: Path, why: str) -> BuildError:
    return BuildError(f"ops cache: {path}: {why}")


@dataclass
class Entry:
    """A verified library in the cache."""

    path: Path
    meta: dict
    sha256: str


class OpsCache:
    """One cache root, opened once and checked; every operation below is relative to it."""

    def __init__(self, root: Path):
        self.root = Path(root)
        try:
            os.makedirs(self.root, mode=0o755, exist_ok=True)
            self.fd = os.open(self.root, _DIR_FLAGS)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.root):
                raise _refused(self.root, "is a symbolic link; give the directory itself") from None
            raise BuildError(f"ops cache: cannot use {self.root}: {e.strerror}") from None
        why = _why_untrusted(os.fstat(self.fd), "dir")
        if why:
            os.close(self.fd)
            raise _refused(self.root, why + " (choose a directory only you can write: --cache-dir or "
                                            "DSLAUNCH_OPS_CACHE)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- opening things without following links ------------------------------------------

    def _open(self, name: str, dir_fd: int, path: Path, kind: str, flags: int = 0, mode: int = 0o644,
              missing_ok: bool = True) -> Optional[int]:
        """openat(dir_fd, name, O_NOFOLLOW | flags), then the ownership/mode checks on the
        descriptor itself. None when it does not exist (and missing_ok)."""
        base = _DIR_FLAGS if kind == "dir" else os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, base | flags, mode, dir_fd=dir_fd)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    st = None
                if st is not None and (_why_untrusted(st, kind) or e.errno == errno.EEXIST):
                    raise _refused(path, _why_untrusted(st, kind) or "already exists") from None
            raise BuildError(f"ops cache: cannot open {path}: {e.strerror}") from None
        why = _why_untrusted(os.fstat(fd), kind)
        if why:
            os.close(fd)
            raise _refused(path, why)
        return fd

    def _entry_dir(self, entry: str, create: bool = False) -> Optional[int]:
        path = self.root / entry
        fd = self._open(entry, self.fd, path, "dir")
        if fd is None and create:
            os.mkdir(entry, 0o755, dir_fd=self.fd)
            fd = self._open(entry, self.fd, path, "dir", missing_ok=False)
            os.fchmod(fd, 0o755)  # a umask of 002 must not make our own entry untrusted
        return fd

    def _read(self, dir_fd: int, name: str, path: Path) -> Optional[bytes]:
        fd = self._open(name, dir_fd, path, "file")
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read()

    # -- the operations the builder uses --------------------------------------------------

    def lock(self, entry: str) -> "_Lock":
        return _Lock(self, f"{entry}.lock")

    def lookup(self, entry: str, symbols: Iterable[str]) -> Optional[Entry]:
        """The entry's library, verified; None when it is not (completely) built.
        Raises BuildError for an untrusted entry and Damaged for a broken one."""
        dfd = self._entry_dir(entry)
        if dfd is None:
            return None
        try:
            raw = self._read(dfd, RECORD, self.root / entry / RECORD)
            if raw is None:
                return None
            try:
                meta = json.loads(raw)
                lib = meta["library"]
                want = meta["sha256"]
            except (ValueError, KeyError, TypeError) as e:
                raise Damaged(f"{self.root / entry / RECORD}: unreadable build record ({e})") from None
            if not isinstance(lib, str) or "/" in lib or lib in ("", ".", ".."):
                raise Damaged(f"{self.root / entry / RECORD}: bad library name {lib!r}")
            path = self.root / entry / lib
            data = self._read(dfd, lib, path)
            if data is None:
                raise Damaged(f"{path}: missing (build.json names it)")
            check_library(path, data, want, symbols)
            return Entry(path, meta, want)
        finally:
            os.close(dfd)

    def open_library(self, found: Entry) -> int:
        """A descriptor on the library, re-checked and re-hashed, for dlopen via /proc/self/fd."""
        dfd = self._entry_dir(found.path.parent.name)
        if dfd is None:
            raise Damaged(f"{found.path.parent}: vanished")
        try:
            fd = self._open(found.path.name, dfd, found.path, "file", missing_ok=False)
        finally:
            os.close(dfd)
        h = hashlib.sha256()
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            h.update(chunk)
        if h.hexdigest() != found.sha256:
            os.close(fd)
            raise Damaged(f"{found.path}: changed since it was checked (sha256 {h.hexdigest()[:16]}, "
                          f"expected {found.sha256[:16]})")
        return fd

    def workdir(self, entry: str) -> Path:
        """A fresh private directory inside the entry for the compiler to write into."""
        dfd = self._entry_dir(entry, create=True)
        try:
            # The caller holds the entry's lock, so any other work directory is a dead builder's.
            for old in os.scandir(dfd):
                if old.name.startswith(".build-") and old.is_dir(follow_symlinks=False):
                    remove_workdir(self.root / entry / old.name)
            name = f".build-{os.getpid()}-{secrets.token_hex(4)}"
            os.mkdir(name, 0o700, dir_fd=dfd)
        finally:
            os.close(dfd)
        return self.root / entry / name

    def publish(self, entry: str, work: Path, lib: str, meta: Dict) -> Entry:
        """Move the built library into the entry and write build.json (last, atomically)."""
        dfd = self._entry_dir(entry, create=True)
        try:
            wfd = self._open(work.name, dfd, work, "dir", missing_ok=False)
            try:
                lfd = self._open(lib, wfd, work / lib, "file", missing_ok=False)
                with os.fdopen(lfd, "rb") as f:
                    os.fchmod(f.fileno(), 0o755)
                    data = f.read()
                meta = dict(meta, library=lib, sha256=hashlib.sha256(data).hexdigest())
                os.replace(lib, lib, src_dir_fd=wfd, dst_dir_fd=dfd)
            finally:
                os.close(wfd)
            tmp = RECORD + ".tmp"
            self._remove_stale(dfd, tmp, self.root / entry / tmp)
            tfd = self._open(tmp, dfd, self.root / entry / tmp, "file",
                             flags=os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode=0o644, missing_ok=False)
            with os.fdopen(tfd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(meta, f, indent=1)
            os.replace(tmp, RECORD, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
        return Entry(self.root / entry / lib, meta, meta["sha256"])

    def invalidate(self, entry: str) -> None:
        """Make an entry "not built" (the caller holds its lock and rebuilds it)."""
        dfd = self._entry_dir(entry)
        if dfd is not None:
            try:
                self._remove_stale(dfd, RECORD, self.root / entry / RECORD)
            finally:
                os.close(dfd)

    def _remove_stale(self, dir_fd: int, name: str, path: Path) -> None:
        """Unlink a leftover regular file of ours (never through a link: a link is refused)."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        why = _why_untrusted(st, "file")
        if why:
            raise _refused(path, why)
        os.unlink(name, dir_fd=dir_fd)


def check_library(path: Path, data: bytes, sha256: Optional[str], symbols: Iterable[str]) -> None:
    """Raise Damaged unless `data` hashes to `sha256` (when given) and exports `symbols`."""
    if sha256 is not None:
        got = hashlib.sha256(data).hexdigest()
        if got != sha256:
            raise Damaged(f"{path}: sha256 {got[:16]} differs from {sha256[:16]} recorded in build.json "
                          f"(truncated or modified, {len(data)} bytes)")
    try:
        exported = exported_functions(data)
    except ElfError as e:
        raise Damaged(f"{path}: {e}") from None
    missing = [s for s in symbols if s not in exported]
    if missing:
        raise Damaged(f"{path}: does not export {', '.join(missing)} "
                      f"(exported functions: {', '.join(sorted(exported)[:8]) or 'none'})")


def remove_workdir(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)  # fd-based on Linux: never follows links inside


class _Lock:
    """Exclusive flock on <root>/<entry>.lock, opened without following links; says once
    on stderr that it waits for another builder. An flock dies with its process, so a
    builder killed half-way leaves nothing stale behind."""

    def __init__(self, cache: OpsCache, name: str):
        self.cache, self.name, self.fd = cache, name, -1

    def __enter__(self):
        path = self.cache.root / self.name
        self.fd = self.cache._open(self.name, self.cache.fd, path, "file", flags=os.O_RDWR | os.O_CREAT,
                                   mode=0o600, missing_ok=False)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"dslaunch: waiting for another process building in {path}", file=sys.stderr)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
