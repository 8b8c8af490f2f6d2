"""MPI-style hostfiles: one `[user@]host slots=N` per line.

Grammar (strict, because a hostfile that is silently misread launches the wrong job):
    line     := [entry] [comment]
    entry    := [user "@"] host (whitespace "slots=" N)
    comment  := "#" anything           (whole-line or trailing)
Blank lines are ignored. `slots=` is required and must be a whole number in 1..MAX_SLOTS; any other
key, a repeated host, or a file with no hosts is an error naming file:line.

Pure: no network, no processes; the caller decides what the hosts mean.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from dslaunch.launcher.bounded_read import read_bounded
from dslaunch.launcher.errors import LaunchConfigError
from dslaunch.launcher.options import MAX_SLOTS

# Host names and IPv4 addresses. ':' and '@' are excluded because --include/--exclude use
# them as separators, so a host that contained them could never be filtered.
HOSTFILE_LIMIT = 16 << 20  # half a million hosts: far beyond any job, and bounded (read_bounded)
_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class HostSpec:
    """One host of the job and the number of worker slots (GPUs) it offers."""

    host: str
    user: Optional[str]
    slots: int
    source: str  # "path:line" of the hostfile entry, for error messages

    @property
    def ssh_target(self) -> str:
        return join_user(self.user, self.host)


def join_user(user: Optional[str], host: str) -> str:
    """The one place `user@host` is built (SSH targets, pdsh -w lists, output prefixes)."""
    return f"{user}@{host}" if user else host


def split_user(target: str) -> "tuple[Optional[str], str]":
    """"alice@node1" -> ("alice", "node1"); "node1" -> (None, "node1")."""
    user, at, host = target.rpartition("@")
    return (user or None, host) if at else (None, target)


def parse_hostfile(path: str | Path) -> List[HostSpec]:
    """Read and parse a hostfile; every problem raises LaunchConfigError naming file[:line]."""
    p = Path(path)
    try:
        text = read_bounded(p, HOSTFILE_LIMIT, "hostfile", LaunchConfigError).decode("utf-8")
    except FileNotFoundError:
        raise LaunchConfigError(f"{path}: hostfile not found") from None
    except UnicodeDecodeError as e:
        raise LaunchConfigError(f"{path}: hostfile is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise LaunchConfigError(f"{path}: cannot read hostfile ({e.strerror})") from None
    return parse_hostfile_text(text, str(path))


def parse_hostfile_text(text: str, filename: str = "<hostfile>") -> List[HostSpec]:
    hosts: List[HostSpec] = []
    seen = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        where = f"{filename}:{lineno}"
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec = _parse_entry(line, where)
        if spec.host in seen:
            raise LaunchConfigError(f"{where}: duplicate host {spec.host!r} (first listed at {seen[spec.host]})")
        seen[spec.host] = where
        hosts.append(spec)
    if not hosts:
        raise LaunchConfigError(f"{filename}: hostfile lists no hosts")
    return hosts


def _parse_entry(line: str, where: str) -> HostSpec:
    target, *fields = line.split()
    user: Optional[str] = None
    host = target
    if "@" in target:
        user, _, host = target.partition("@")
        if not _USER_RE.match(user or "") or "@" in host:
            raise LaunchConfigError(f"{where}: invalid user@host {target!r}")
    if not _HOST_RE.match(host):
        raise LaunchConfigError(f"{where}: invalid host name {host!r}")
    slots: Optional[int] = None
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq:
            raise LaunchConfigError(f"{where}: expected 'slots=N' after the host, got {field!r}")
        if key != "slots":
            raise LaunchConfigError(f"{where}: unknown key {key!r} (only slots=N is allowed)")
        if slots is not None:
            raise LaunchConfigError(f"{where}: slots given twice for host {host!r}")
        if not value.isdigit() or not value.isascii():
            raise LaunchConfigError(f"{where}: slots={value} is not a whole number")
        # compared as text first: int() of a 5000-digit string is itself an error
        slots = int(value) if len(value) <= 6 else MAX_SLOTS + 1
        if slots < 1:
            raise LaunchConfigError(f"{where}: slots={value}: a host needs at least 1 slot")
        if slots > MAX_SLOTS:
            raise LaunchConfigError(f"{where}: slots={value}: more than {MAX_SLOTS} slots on one host")
    if slots is None:
        raise LaunchConfigError(f"{where}: host {host!r} has no slots=N")
    return HostSpec(host=host, user=user, slots=slots, source=where)
