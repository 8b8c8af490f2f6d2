"""Start `python script.py ...` by forking a warm interpreter that has already imported torch.

Why: a fresh rank spends about 5 s of CPU before its first line of test code, importing
torch, torch.distributed and torch._dynamo (torch.optim.Optimizer.__init__ imports dynamo at
the first optimizer). On the suite's 2-core machine, a two-rank test of a tiny model was
7 s of that and 1 s of work. A warm process pays it once per session and forks each rank.

What a rank sees is what a fresh `python script.py` would see, except that those modules
are loaded already:
- the rank's own environment (os.environ replaced whole), working directory, umask, argv,
  stdin (/dev/null), stdout and stderr (its files, passed over the socket);
- its own session and process group (setsid), so killpg(pid) and kill(pid) work as on a
  Popen started with start_new_session=True;
- its own random state: Python's random module reseeds itself at fork, numpy is reseeded
  here, torch's generator is at its default seed as in a fresh process (the warm process
  draws nothing);
- it exits through the interpreter's normal end (atexit handlers, flush, finalisation), so a
  rank that would crash at exit in a fresh process crashes here too.
Ranks of one job differ in their string-hash seed as fresh processes do: each rank number has
its own warm process (a set iterated in another order on another rank still shows).

What is read while torch imports (OpenMP, MKL and oneDNN settings, torch's own variables,
the interpreter's) comes from the warm process's environment, so a warm process serves only
ranks whose values of those variables are its own; another set of values gets another warm
process. DSLAUNCH_TEST_FORK=0 starts every rank as a fresh interpreter instead.

Protocol (one Unix-socket connection per rank): the client sends a pickled request and the
rank's stdout and stderr descriptors; the warm process forks, answers the rank's pid, and
later its exit status as Popen.returncode would give it (negative: killed by that signal).
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

HERE = os.path.abspath(__file__)
FORK_VAR = "DSLAUNCH_TEST_FORK"
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")
# Variables a process reads while it starts and imports torch; a warm process is kept per set
# of their values. (TMPDIR is not one: tempfile's cached folder is dropped in the child.)
_IMPORT_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH", "PYTORCH_", "CUDA_",
                         "NCCL_", "LD_", "PYTHON", "MALLOC_")
_MAX_WARM = 12  # the least recently used one ends beyond this (each holds a few hundred MB)
_READY = b"ready\n"
_START_TIMEOUT = 120.0


def enabled(env: Dict[str, str]) -> bool:
    return env.get(FORK_VAR, os.environ.get(FORK_VAR, "1")) != "0" and sys.platform.startswith("linux") \
        and env.get("DSLAUNCH_TEST_BACKEND", "gloo") != "nccl"


def forkable(cmd: List[str]) -> bool:
    """`python script.py ...` with this interpreter and no interpreter options."""
    return len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py") and not cmd[1].startswith("-")


def _key(env: Dict[str, str]) -> Tuple:
    sensitive = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)))
    return env.get("RANK", "0"), sensitive


# ---------------------------------------------------------------------------------- client side

def _send_msg(sock: socket.socket, payload: bytes, fds: List[int]) -> None:
    """A length-prefixed pickle, with the rank's stdout and stderr passed beside its header."""
    socket.send_fds(sock, [struct.pack("!Q", len(payload))], list(fds))
    sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return buf


@dataclass
class _Warm:
    proc: subprocess.Popen
    sock_path: str
    folder: str


_warm: Dict[Tuple, _Warm] = {}


# A Unix socket's path has room for 107 bytes; a long TMPDIR falls back to /tmp.
_SOCK_PATH_MAX = 100


def _spawn_warm(env: Dict[str, str]) -> _Warm:
    folder = tempfile.mkdtemp(prefix="warm-rank-")
    if len(os.path.join(folder, "sock")) > _SOCK_PATH_MAX:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="warm-rank-", dir="/tmp")
    sock_path = os.path.join(folder, "sock")
    start_env = {k: v for k, v in env.items()
                 if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    with open(os.path.join(folder, "log"), "w") as log:
        proc = subprocess.Popen([sys.executable, HERE, sock_path], env=start_env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, cwd=os.path.dirname(HERE), start_new_session=True)
    return _Warm(proc, sock_path, folder)


def _await_ready(warm: _Warm) -> Optional[str]:
    """None once the process says it is ready; else why it did not start (it is then ended)."""
    ready, _, _ = select.select([warm.proc.stdout], [], [], _START_TIMEOUT)
    line = warm.proc.stdout.readline() if ready else b""
    if line == _READY:
        return None
    with open(os.path.join(warm.folder, "log")) as fh:
        log = fh.read()[-3000:]
    if warm.proc.poll() is None:  # hung in its start: nothing to end gracefully, so no 20 s wait
        os.killpg(warm.proc.pid, signal.SIGKILL)
        warm.proc.wait()
    _stop(warm)
    return log


def prepare(envs: List[Dict[str, str]]) -> None:
    """Start the warm processes these ranks need and do not have yet, side by side. Every one
    started is awaited, so none stays registered before its socket is bound; one that does not
    start is dropped and the call raises."""
    started = []
    for env in envs:
        key = _key(env)
        warm = _warm.pop(key, None)  # re-inserted last: the dict's order is the order of use
        if warm is None or warm.proc.poll() is not None:
            if warm is not None:
                _stop(warm)
            while len(_warm) >= _MAX_WARM:
                _stop(_warm.pop(next(iter(_warm))))
            warm = _spawn_warm(env)
            started.append((key, warm))
        _warm[key] = warm
    failures = []
    for key, warm in started:
        log = _await_ready(warm)
        if log is not None:
            del _warm[key]
            failures.append(log)
    if failures:
        raise RuntimeError(f"the warm rank process did not start ({FORK_VAR}=0 starts fresh ones):\n{failures[0]}")


class WarmRank:
    """A process forked from a warm interpreter: the part of subprocess.Popen the harness uses
    (pid, poll, wait, returncode)."""

    def __init__(self, cmd: List[str], env: Dict[str, str], stdout, stderr, cwd: Optional[str]):
        warm = _warm.get(_key(env))
        if warm is None:
            raise RuntimeError("warm_ranks.prepare() was not called for this rank's environment")
        request = {"argv": list(cmd[1:]), "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd()),
                   "umask": _current_umask()}
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(warm.sock_path)
        _send_msg(self._sock, pickle.dumps(request), [stdout.fileno(), stderr.fileno()])
        self.pid = struct.unpack("!q", _recv_exact(self._sock, 8))[0]
        self.args = cmd
        self.returncode: Optional[int] = None

    def _read_status(self, timeout: Optional[float]) -> None:
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return
        try:
            self.returncode = struct.unpack("!q", _recv_exact(self._sock, 8))[0]
        except EOFError:  # the warm process is gone: so is the rank (it killed its children)
            self.returncode = -signal.SIGKILL
        self._sock.close()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._read_status(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stop(warm: _Warm) -> None:
    """End a warm process: it kills the ranks it still runs, then exits."""
    try:
        warm.proc.stdin.close()
        warm.proc.wait(timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        os.killpg(warm.proc.pid, signal.SIGKILL)
        warm.proc.wait()
    warm.proc.stdout.close()
    for name in ("sock", "log"):
        try:
            os.unlink(os.path.join(warm.folder, name))
        except FileNotFoundError:
            pass
    os.rmdir(warm.folder)


def stop_all() -> None:
    """End every warm process of this session."""
    while _warm:
        _stop(_warm.pop(next(iter(_warm))))


# ------------------------------------------------------------------------------- warm process side

def _serve(sock_path: str):
    """Accept requests until stdin closes; returns only in a forked child, with its request."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports made lives as long as a rank does: out of the collector's reach, a rank's
    # collections (the harness's teardown makes one, the interpreter's end another) do not walk
    # it, and do not touch (copy) the pages it shares with this process.
    import gc

    gc.collect()
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(64)
    children: Dict[int, socket.socket] = {}
    sys.stdout.buffer.write(_READY)
    sys.stdout.flush()
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([server, stdin], [], [], 0.02)
        if stdin in ready and not os.read(stdin.fileno(), 1):
            break
        if server in ready:
            conn, _ = server.accept()
            header, fds, _, _ = socket.recv_fds(conn, 8, 2)
            header += _recv_exact(conn, 8 - len(header))
            request = pickle.loads(_recv_exact(conn, struct.unpack("!Q", header)[0]))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in children.values():
                    other.close()
                return conn, fds, request
            for fd in fds:
                os.close(fd)
            conn.sendall(struct.pack("!q", pid))
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!q", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in list(children):
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    server.close()
    sys.exit(0)


def _become(conn: socket.socket, fds: List[int], request: dict) -> str:
    """Turn the forked child into the requested process; returns the script to run."""
    conn.close()
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (devnull, *fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # asked again, of this environment's TMPDIR
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if request["env"].get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()  # on the rank's stderr
    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)
    return script


if __name__ == "__main__":
    import runpy

    child = _serve(sys.argv[1])
    runpy.run_path(_become(*child), run_name="__main__")
