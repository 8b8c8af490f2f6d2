"""Reading a small file someone named: at most a set number of bytes, and regular files only.

Hostfiles, env files, configs, checkpoints' `latest`, manifests and descriptors are all
read whole before they are parsed. A plain open() and read() of such a path trusts it too
much: a FIFO blocks open() until someone writes to it (forever, for a hang), a device such
as /dev/zero never reaches its end (the reader grows until the kernel kills it), and a
file of many gigabytes is read whole before any parser can object. So read_bounded:

- refuses anything but a regular file before opening it (stat), and again after (fstat
  of the descriptor actually read: a path swapped in between is caught);
- opens with O_NONBLOCK, so even a FIFO swapped in after the stat cannot block the open,
  and O_NOCTTY, so a terminal never becomes our controlling one;
- reads at most `limit` bytes and refuses a file with more.

Symbolic links are followed: a user may well keep a hostfile behind one. Errors from
open() itself (no such file, permission denied) are raised as the OSError they are, so
each caller keeps its own wording for them; a refusal is `error(message)`, one line that
names the file and what it was meant to be. This module imports nothing heavy: the
launcher and the runtime's config reader both use it.
"""
from __future__ import annotations

import os
import stat
from typing import Type

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def not_regular(path: str, what: str, mode: int) -> str:
    """The one line that refuses a path that is not a regular file."""
    return f"{path}: {what} is {_kind(mode)}, not a regular file; refusing to read it"


def read_bounded(path: "str | os.PathLike", limit: int, what: str,
                 error: Type[Exception] = ValueError) -> bytes:
    """The bytes of regular file `path`, at most `limit` of them; `what` names the file's
    role in a refusal ("hostfile", "config file"), which is raised as error(message)."""
    path = os.fspath(path)
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise error(not_regular(path, what, st.st_mode))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(not_regular(path, what, st.st_mode))
        if st.st_size > limit:
            raise error(f"{path}: {what} is {st.st_size} bytes, over its limit of {size_text(limit)}; "
                        "refusing to read it")
        chunks, got = [], 0
        while got <= limit:  # st_size can lie (a file still growing, /proc): count what is read
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:
            raise error(f"{path}: {what} is over its limit of {size_text(limit)}; refusing to read it")
        return b"".join(chunks)
    finally:
        os.close(fd)
