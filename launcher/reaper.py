"""Process-tree plumbing for the supervisor: parent-death signals, subreaping, tree kills.

Four mechanisms together give "no orphans, ever":
- each worker gets PR_SET_PDEATHSIG, so the kernel signals it the moment the supervisor
  dies, even by SIGKILL. The setting is per *thread* of the parent and is not inherited
  by the worker's own children, which is why it is not enough alone;
- the supervisor marks itself a child subreaper, so a worker's orphaned descendants are
  re-parented to it (not to init) and remain findable as its descendants for teardown;
- watchdog.py, a separate process, cleans up after a supervisor that was SIGKILLed;
- keeper.py: a launch forks once, and the parent (the pid the user started) is a child
  subreaper above the job process, so what a SIGKILLed job process leaves, even without
  the job's marker in its environment, is re-parented to the keeper, which ends it.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Dict, Iterable, List, Optional, Set

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

_libc = None


def _prctl():
    global _libc
    if _libc is None and sys.platform.startswith("linux"):
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc.prctl if _libc is not None else None


def become_subreaper() -> bool:
    prctl = _prctl()
    return bool(prctl) and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def stop_subreaping() -> None:
    prctl = _prctl()
    if prctl:
        prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def set_death_signal(sig: int) -> bool:
    """This process gets `sig` when the thread that forked it ends (PR_SET_PDEATHSIG)."""
    prctl = _prctl()
    return bool(prctl) and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def make_child_setup(death_signal: int = signal.SIGTERM, cpus: Optional[Iterable[int]] = None):
    """A preexec_fn that ties the child's life to this process (Linux; no-op elsewhere)
    and, with `cpus`, pins it to those cores before it runs a line of its own code, so every
    thread it starts later (OpenMP, torch intra-op) inherits the pinning.

    Resolved in the parent so the child runs no imports between fork and exec (a
    preexec_fn in a process with other threads must not take locks another thread may
    hold). PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so
    spawn from a thread that lives as long as the workers (Supervisor.run does).
    """
    prctl = _prctl()
    parent = os.getpid()
    affinity = None if cpus is None else frozenset(cpus)
    setaffinity = os.sched_setaffinity

    def setup() -> None:
        if affinity is not None:
            setaffinity(0, affinity)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
        # The parent may have died between fork and prctl; then nobody would signal us.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return setup


def _parent_map() -> Dict[int, List[int]]:
    """ppid -> [pid] for every process, from /proc/*/stat (what psutil does, without importing it).

    The fallback for kernels without /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN):
    it reads every process on the machine, so a walk costs O(processes), not O(subtree).
    """
    kids: Dict[int, List[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                # comm may contain spaces and ')': the fields after the last ')' are fixed.
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


_children_files: Optional[bool] = None  # does this kernel have /proc/PID/task/TID/children?


def _has_children_files() -> bool:
    global _children_files
    if _children_files is None:
        _children_files = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return _children_files


def _direct_children(pid: int) -> List[int]:
    """pid's children from the kernel's own lists: one small file per thread of pid.

    A child hangs on the list of the thread that forked it (or, when that thread exited, of
    another thread of the process; orphans re-parented to a subreaper likewise), so every
    thread's list is read. A pid that is gone has no children.
    """
    out: List[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(k) for k in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def children(pid: int) -> List[int]:
    if _has_children_files():
        return _direct_children(pid)
    return _parent_map().get(pid, [])


def descendants(pid: int, exclude: Iterable[int] = ()) -> List[int]:
    """Every process below `pid`, except the subtrees rooted at the pids in `exclude`.

    Walks down from pid through the kernel's per-thread children lists, so the cost is the
    size of pid's subtree, not of the machine's process table: a node agent tearing down
    its few workers reads a few files, however many other processes the host runs. (With N
    simulated agents on one host, a scan of all of /proc per walk made teardown O(N^2).)
    """
    if _has_children_files():
        kids_of = _direct_children
    else:
        table = _parent_map()
        kids_of = lambda p: table.get(p, [])  # noqa: E731
    skip = set(exclude)
    out: List[int] = []
    seen = {pid}
    todo = [k for k in kids_of(pid) if k not in skip]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        todo.extend(k for k in kids_of(p) if k not in skip)
    return out


def signal_processes(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def group_of(pid: int) -> Optional[int]:
    """pid's process group, or None when it is gone."""
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def signal_groups(pgids: Iterable[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap(pids: Iterable[int]) -> Set[int]:
    """waitpid(WNOHANG) the given adopted orphans; returns those still running.

    Never waitpid(-1): that could steal the exit status of a worker its Popen still waits for.
    """
    alive = set()
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue  # not our child (yet or any more): leave it to its parent
        if done == 0:
            alive.add(pid)
    return alive


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


_PF_EXITING = 0x4  # include/linux/sched.h: the task has begun to exit


def exiting(pid: int) -> bool:
    """True once pid has begun to exit (or is a zombie): the kernel sets PF_EXITING before it
    closes the process's files, so a peer that saw its sockets close finds it exiting here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return False


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def exit_code_of(returncode: Optional[int]) -> int:
    """Popen returncode -> shell-style exit code: -N (killed by signal N) becomes 128+N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode
