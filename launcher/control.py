"""The head's control socket and `dslaunch drain HOST` / `dslaunch undrain HOST`.

An elastic job's head listens on a Unix socket, CONTROL_DIR/<run id>.sock (CONTROL_DIR:
$XDG_RUNTIME_DIR/dslaunch, else /tmp/dslaunch-<uid>, made 0700 and refused when another user
owns it). A client writes one JSON line, {"cmd": "drain"|"undrain", "host": HOST}; the head
answers with one, {"ok": bool, "text": "..."}, and closes. The command prints the text and
exits 0, or 2 when the head refused (a host not in the job, one that would leave fewer than
--min_nodes) or no job could be found.

drain: the runtime saves at the next step boundary, the job stops and goes on without the
host, which stays out until `dslaunch undrain HOST`.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import click

from dslaunch.launcher.errors import LaunchConfigError

REPLY_TIMEOUT_S = 30.0  # the head answers from its event loop, between two events


def control_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "dslaunch" if base else Path(f"/tmp/dslaunch-{os.getuid()}")


def _private_dir(path: Path) -> Path:
    """Create the folder 0700, and refuse one that another user owns or others may write
    (a socket there could be replaced by someone else's)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LaunchConfigError(f"{path}: owned by another user or writable by others; the control socket of "
                                "an elastic job cannot live there (set XDG_RUNTIME_DIR to a private folder)")
    return path


@dataclass(frozen=True)
class Request:
    cmd: str  # "drain" | "undrain"
    host: str


class ControlServer:
    """Accepts requests on a thread; `handle(request) -> (ok, text)` answers each (the head
    routes it through its event loop, so it may take until the loop's next turn)."""

    def __init__(self, run_id: str, handle: Callable[[Request], "tuple[bool, str]"]):
        self.path = _private_dir(control_dir()) / f"{run_id}.sock"
        self._handle = handle
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path.unlink(missing_ok=True)
        self._sock.bind(str(self.path))
        os.chmod(self.path, 0o600)
        self._sock.listen(8)
        self._closed = False
        threading.Thread(target=self._serve, daemon=True, name="dslaunch-control").start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True, name="dslaunch-control-req").start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(REPLY_TIMEOUT_S)
            try:
                raw = conn.makefile("rb").readline(4096)
                msg = json.loads(raw)
                request = Request(str(msg["cmd"]), str(msg["host"]))
                if request.cmd not in ("drain", "undrain"):
                    raise ValueError(request.cmd)
            except (OSError, ValueError, KeyError, TypeError):
                self._reply(conn, False, "not a request this head understands")
                return
            ok, text = self._handle(request)
            self._reply(conn, ok, text)

    @staticmethod
    def _reply(conn: socket.socket, ok: bool, text: str) -> None:
        try:
            conn.sendall((json.dumps({"ok": ok, "text": text}) + "\n").encode())
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        finally:
            self.path.unlink(missing_ok=True)


def running_jobs() -> List[str]:
    """Run ids of this user's elastic jobs whose head answers on its socket."""
    folder = control_dir()
    out = []
    for p in sorted(folder.glob("*.sock")) if folder.is_dir() else []:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(p))
            out.append(p.stem)
        except OSError:
            pass  # a head that died without removing its socket
        finally:
            s.close()
    return out


def ask(run_id: str, cmd: str, host: str) -> "tuple[bool, str]":
    path = control_dir() / f"{run_id}.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(REPLY_TIMEOUT_S + 5)
    try:
        s.connect(str(path))
        s.sendall((json.dumps({"cmd": cmd, "host": host}) + "\n").encode())
        raw = s.makefile("rb").readline(65536)
    except OSError as exc:
        raise LaunchConfigError(f"job {run_id}: its head does not answer on {path} ({exc.strerror or exc})") from None
    finally:
        s.close()
    try:
        reply = json.loads(raw)
        return bool(reply["ok"]), str(reply["text"])
    except (ValueError, KeyError, TypeError):
        raise LaunchConfigError(f"job {run_id}: its head's answer is not understood: {raw[:80]!r}") from None


def _pick_job(job: Optional[str]) -> str:
    jobs = running_jobs()
    if job is not None:
        if job not in jobs:
            raise LaunchConfigError(f"--job {job}: no running elastic job of yours has that run id "
                                    f"(running: {', '.join(jobs) or 'none'})")
        return job
    if not jobs:
        raise LaunchConfigError(f"no running elastic job of yours (no head answers in {control_dir()})")
    if len(jobs) > 1:
        raise LaunchConfigError(f"{len(jobs)} elastic jobs are running ({', '.join(jobs)}): name one with --job")
    return jobs[0]


def _run(cmd: str, host: str, job: Optional[str]) -> None:
    try:
        ok, text = ask(_pick_job(job), cmd, host)
    except LaunchConfigError as exc:
        click.echo(f"dslaunch {cmd}: error: {exc}", err=True)
        raise SystemExit(2)
    if not ok:
        click.echo(f"dslaunch {cmd}: error: {text}", err=True)
        raise SystemExit(2)
    click.echo(f"dslaunch {cmd}: {text}")


_JOB_HELP = "The run id of the job (the head prints it; needed when several elastic jobs run)."


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--job", default=None, help=_JOB_HELP)
@click.argument("host")
def drain(host: str, job: Optional[str]) -> None:
    """Take HOST out of a running elastic job without losing a step: the job saves a
    checkpoint at the next step boundary and goes on on the other hosts. HOST stays out
    until `dslaunch undrain HOST`."""
    _run("drain", host, job)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--job", default=None, help=_JOB_HELP)
@click.argument("host")
def undrain(host: str, job: Optional[str]) -> None:
    """Let a drained HOST join its elastic job again (at the job's next checkpoint)."""
    _run("undrain", host, job)
