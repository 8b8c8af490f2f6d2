"""Files the launcher writes into directories a user named: never through a link, never
where another user can write.

dslaunch often runs as root, and the working directory or --log_dir may be shared with
other users. A directory another user can write lets that user plant `rank_0.log ->
/etc/shadow` or `.dslaunch -> /their/dir` before we write, or swap a file between our
write and its reader's read. So:

- a directory we write into is opened once (O_DIRECTORY) and checked on the descriptor
  (fstat, so what is checked is what is used): owned by us (or root), and writable by no
  other user: not by "other", and not by its group unless that group is ours alone
  (a user-private group, which umask 002 systems rely on);
- every file in it is opened relative to that descriptor with O_NOFOLLOW (a planted link
  is refused, not followed), O_NONBLOCK (a planted FIFO cannot block the open), and then
  checked on its descriptor: a regular file of ours with one link (a hard link to another
  file of ours would send our bytes there);
- a private directory (the pdsh request folder) must be a real directory (not a link to
  one) owned by us, and is made 0700: no other user can list, read or add to it;
- a file only we may read (a pdsh request: argv, secrets, the control token) is created
  with O_EXCL, 0600, inside such a directory; its reader (the node agent) checks the
  directory and the file the same way before trusting a byte of it.
Every refusal is a LaunchConfigError: one line naming the path and what is wrong.
"""
from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from typing import Optional

from dslaunch.launcher.bounded_read import not_regular, size_text
from dslaunch.launcher.errors import LaunchConfigError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group_is_mine_alone(gid: int) -> bool:
    """True when no user but us can be in group `gid`: our own primary group, with no
    supplementary member and no other account whose primary group it is."""
    me = os.geteuid()
    if gid != os.getegid():
        return False
    try:
        name = pwd.getpwuid(me).pw_name
        if set(grp.getgrgid(gid).gr_mem) - {name}:
            return False
        return not any(p.pw_gid == gid and p.pw_uid != me for p in pwd.getpwall())
    except KeyError:
        return False


def others_who_can_write(st: os.stat_result) -> Optional[str]:
    """Who besides us (and root) can add, remove or rename entries of this directory; None if nobody."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"its owner {_user(st.st_uid)}"
    if st.st_mode & stat.S_IWOTH:
        return f"every user (mode {stat.S_IMODE(st.st_mode):04o})"
    if st.st_mode & stat.S_IWGRP and not _group_is_mine_alone(st.st_gid):
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = str(st.st_gid)
        return f"group {group} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def open_shared_dir(path: str, what: str) -> int:
    """A descriptor of directory `path` (made with its parents if missing), refused if
    another user can write it. The path is the user's own and may pass through links."""
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        raise LaunchConfigError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    who = others_who_can_write(os.fstat(fd))
    if who is not None:
        os.close(fd)
        raise LaunchConfigError(f"{what} {path}: {who} can write there, and could plant links for dslaunch to "
                                "write through; give a directory only you can write")
    return fd


def open_private_dir(path: str, what: str) -> int:
    """A descriptor of `path`, a real directory owned by us and made mode 0700 (created so
    when missing). A link, another user's directory or anything else is refused."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise LaunchConfigError(f"{what} {path}: cannot create it ({e.strerror or e})") from None
    try:
        fd = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as e:
        st = _lstat(path)
        kind = "a symbolic link" if st is not None and stat.S_ISLNK(st.st_mode) else \
            "not a directory" if st is not None and not stat.S_ISDIR(st.st_mode) else (e.strerror or str(e))
        raise LaunchConfigError(f"{what} {path} is {kind}; dslaunch keeps its private files only in a directory "
                                "of its own: remove it") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise LaunchConfigError(f"{what} {path} is owned by {_user(st.st_uid)}, not by you; dslaunch keeps its "
                                "private files only in a directory of its own: remove it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # ours: nobody else may list it or add to it from now on
    return fd


def _lstat(path: str) -> Optional[os.stat_result]:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _check_own_file(fd: int, path: str, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        problem = not_regular(path, what, st.st_mode)
    elif st.st_uid != os.geteuid():
        problem = f"{path}: {what} is owned by {_user(st.st_uid)}, not by you; refusing it"
    elif st.st_nlink != 1:
        problem = f"{path}: {what} has {st.st_nlink} hard links (another name for the same file); refusing it"
    else:
        return st
    os.close(fd)
    raise LaunchConfigError(problem)


def open_append(dir_fd: int, name: str, path: str, what: str) -> int:
    """A descriptor appending to `name` in the directory `dir_fd` (created 0644 if missing);
    `path` is its full name for messages. A link, a FIFO or another user's file is refused."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _FILE_FLAGS, 0o644, dir_fd=dir_fd)
    except OSError as e:
        st = os.lstat(name, dir_fd=dir_fd) if e.errno in (errno.ELOOP, errno.ENXIO) else None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise LaunchConfigError(f"{path}: {what} is a symbolic link; refusing to write through it") from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise LaunchConfigError(not_regular(path, what, st.st_mode).replace("read", "write")) from None
        raise LaunchConfigError(f"{path}: cannot open {what} ({e.strerror or e})") from None
    _check_own_file(fd, path, what)
    os.set_blocking(fd, True)
    return fd


def create_private(dir_fd: int, name: str, data: bytes, path: str) -> None:
    """Write a new file `name` (mode 0600) into the private directory `dir_fd`; never an existing one."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FILE_FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise LaunchConfigError(f"{path}: cannot create it ({e.strerror or e})") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def read_private(path: str, limit: int, what: str) -> bytes:
    """Read, then remove, a file only we may read (mode 0600, ours, one link) in a private
    directory (ours, mode 0700, not a link): anything else is refused unread."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        dfd = os.open(folder, _DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as e:
        raise LaunchConfigError(f"{what} {path}: cannot open its folder {folder} ({e.strerror or e}); "
                                "it must be a real directory of yours") from None
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise LaunchConfigError(f"{what} {path}: its folder is owned by {_user(st.st_uid)} with mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}; only a folder of yours that no one else can "
                                    "open (0700) is trusted")
        try:
            fd = os.open(name, os.O_RDONLY | _FILE_FLAGS, dir_fd=dfd)
        except OSError as e:
            raise LaunchConfigError(f"{what} {path}: cannot open it ({e.strerror or e})") from None
        st = _check_own_file(fd, path, what)
        try:
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise LaunchConfigError(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read "
                                        "or write it; refusing it")
            if st.st_size > limit:
                raise LaunchConfigError(f"{what} {path}: {st.st_size} bytes, over its limit of {size_text(limit)}")
            chunks, got = [], 0
            while got <= limit:
                chunk = os.read(fd, limit + 1 - got)
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            data = b"".join(chunks)
            if got > limit:
                raise LaunchConfigError(f"{what} {path}: over its limit of {size_text(limit)}")
        finally:
            os.close(fd)
            try:
                os.unlink(name, dir_fd=dfd)  # read once: its secrets do not stay on disk
            except OSError:
                pass
        return data
    finally:
        os.close(dfd)
