"""Env files: KEY=VALUE lines exported to every worker (`.dslaunch_env`, and DeepSpeed's
`.deepspeed_env`, which Hugging Face Accelerate writes for multi-node DeepSpeed jobs).

Which files, lowest precedence first (a later file's value wins for the same key):

    ~/.deepspeed_env   ~/.dslaunch_env   ./.deepspeed_env   ./.dslaunch_env

as DeepSpeed reads its home file and then its working-directory file. `$DS_ENV_FILE`
renames `.deepspeed_env` as in DeepSpeed. `--env_file F` (or DSLAUNCH_ENV_FILE) replaces
the search: only F is read, and it must exist.

A file in the working directory comes with whatever repository was cloned there, and
can set PYTHONPATH or LD_PRELOAD for every worker: the launcher therefore names every file
it loaded and its keys on every launch (see notices()), and never prints the values.

Grammar: blank lines and lines starting with '#' are ignored; an optional `export `
prefix is accepted so the file can also be sourced by a shell; the value is everything
after the first '=' with surrounding whitespace removed and one pair of matching quotes
stripped. Nothing is expanded: `$HOME` stays `$HOME`. A NUL byte (which no environment
can carry) is an error naming file:line.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from dslaunch.launcher.bounded_read import read_bounded
from dslaunch.launcher.errors import LaunchConfigError

ENV_FILE_NAME = ".dslaunch_env"
ENV_FILE_LIMIT = 1 << 20  # environment variables: Linux caps all of argv and env at a few MiB anyway
DEEPSPEED_ENV_FILE_NAME = ".deepspeed_env"
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvFile:
    path: str
    values: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvFiles:
    """The env files a launch loaded, lowest precedence first."""

    files: Tuple[EnvFile, ...] = ()

    @property
    def values(self) -> Dict[str, str]:
        merged: Dict[str, str] = {}
        for f in self.files:
            merged.update(f.values)
        return merged

    @property
    def paths(self) -> List[str]:
        return [f.path for f in self.files]

    def notices(self) -> List[str]:
        """One line per file: its path and its keys, never its values."""
        out = []
        for f in self.files:
            keys = ", ".join(f.values) if f.values else "no variables"
            out.append(f"env file {f.path} sets {keys} for every worker")
        return out


def parse_env_text(text: str, filename: str) -> Dict[str, str]:
    values: Dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if "\0" in raw:
            raise LaunchConfigError(f"{filename}:{lineno}: contains a NUL byte, which no environment variable can hold")
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, eq, value = line.partition("=")
        key = key.strip()
        if not eq:
            raise LaunchConfigError(f"{filename}:{lineno}: expected KEY=VALUE, got {raw.strip()!r}")
        if not _KEY_RE.match(key):
            raise LaunchConfigError(f"{filename}:{lineno}: {key!r} is not a valid variable name")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def candidate_paths(cwd: Path, home: Path, environ: Mapping[str, str]) -> List[Path]:
    """Where env files are looked for, lowest precedence first."""
    ds_name = environ.get("DS_ENV_FILE") or DEEPSPEED_ENV_FILE_NAME
    out: List[Path] = []
    for directory in (home, cwd):
        for name in (ds_name, ENV_FILE_NAME):
            p = directory / name  # an absolute DS_ENV_FILE stays itself, as in DeepSpeed
            if p not in out:
                out.append(p)
    # the same file reached twice (cwd is home) counts once, at its higher precedence
    return [p for i, p in enumerate(out) if p.resolve() not in {q.resolve() for q in out[i + 1:]}]


def read_env_file(path: Path) -> EnvFile:
    try:
        text = read_bounded(path, ENV_FILE_LIMIT, "env file", LaunchConfigError).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchConfigError(f"{path}: cannot read env file ({getattr(e, 'strerror', None) or e})") from None
    return EnvFile(str(path), parse_env_text(text, str(path)))


def load_env_files(explicit: Optional[str], cwd: Path, home: Path,
                   environ: Optional[Mapping[str, str]] = None) -> EnvFiles:
    if explicit:
        p = Path(explicit)
        if not p.exists():
            raise LaunchConfigError(f"{explicit}: env file (--env_file / DSLAUNCH_ENV_FILE) not found")
        return EnvFiles((read_env_file(p),))
    environ = os.environ if environ is None else environ
    return EnvFiles(tuple(read_env_file(p) for p in candidate_paths(cwd, home, environ)
                             if p.exists()))  # a FIFO or device there is refused by name, not skipped
