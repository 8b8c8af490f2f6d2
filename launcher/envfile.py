"""`.dslaunch_env`: KEY=VALUE lines exported to every worker (DeepSpeed's .deepspeed_env).

Where it comes from, first match wins: --env_file / DSLAUNCH_ENV_FILE (must exist), else
`.dslaunch_env` in the working directory, else in the home directory.

Grammar: blank lines and lines starting with '#' are ignored; an optional `export `
prefix is accepted so the file can also be sourced by a shell; the value is everything
after the first '=' with surrounding whitespace removed and one pair of matching quotes
stripped. Nothing is expanded: `$HOME` stays `$HOME`, so what the file says is what the
worker gets.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from dslaunch.launcher.errors import LaunchConfigError

ENV_FILE_NAME = ".dslaunch_env"
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvFile:
    path: Optional[str]  # None when no file was found
    values: Dict[str, str] = field(default_factory=dict)


def parse_env_text(text: str, filename: str) -> Dict[str, str]:
    values: Dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
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


def find_env_file(explicit: Optional[str], cwd: Path, home: Path) -> Optional[Path]:
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise LaunchConfigError(f"{explicit}: env file (--env_file / DSLAUNCH_ENV_FILE) not found")
        return p
    for candidate in (cwd / ENV_FILE_NAME, home / ENV_FILE_NAME):
        if candidate.is_file():
            return candidate
    return None


def load_env_file(explicit: Optional[str], cwd: Path, home: Path) -> EnvFile:
    path = find_env_file(explicit, cwd, home)
    if path is None:
        return EnvFile(None, {})
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchConfigError(f"{path}: cannot read env file ({e})") from None
    return EnvFile(str(path), parse_env_text(text, str(path)))
