"""Orderly shutdown at interpreter exit.

Why: a process that leaves torch.distributed's process groups alive when the interpreter
finalises can abort with `terminate called without an active exception` (SIGABRT, exit
134) after all its work is done. Gloo's worker threads (and NCCL's watchdog) outlive the
script; when one of them drops the last reference to a tensor while Python is tearing
itself down, it tries to take the GIL, the interpreter ends the thread with pthread_exit,
and the forced unwind through a noexcept C++ frame calls std::terminate. A plain gloo
script without destroy_process_group() does this in roughly a quarter of its runs.

So the runtime tears down what it started while the interpreter is still whole, from an
`atexit` handler registered when dslaunch.runtime.comm is imported (atexit runs
handlers last-registered first, so the user's own handlers, which may still
communicate, run before this one). In order:

  1. stop the collective watchdog and any other runtime thread owner (ZeRO NVMe
     optimizer swapper, ZeRO-3 parameter swapper): pending writes are flushed, their I/O
     threads stopped and their swap files removed;
  2. wait for the asynchronous collectives issued through dslaunch.runtime.comm, and for
     the CUDA device when one was used;
  3. print the comms_logger summary (when enabled);
  4. destroy the process groups created through dslaunch.runtime.comm.new_group, newest
     first, then the default group (and with it every other group), unless the script
     already did; drop our references and collect garbage so the backends' threads are
     joined now rather than during finalisation.

Whether or not the script called destroy_process_group() itself, the end state is the
same. The whole sequence runs under faulthandler's C-level timer: if a backend never
returns (a peer vanished with a collective half done), every thread's stack is printed
and the process exits 1 after `budget_s` seconds instead of hanging.

An uncaught exception is announced first: under dslaunch, the excepthook writes one line
to the pipe the supervisor passed in $DSLAUNCH_ORIGIN_FD before the traceback is printed.
This rank's exit (which destroys its groups) is what makes its peers fail with "Connection
closed by peer", and they may exit before it does; the announcement lets the launcher name
this rank regardless (launcher/supervisor.py).
"""
from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import stat
import sys
import weakref
from datetime import timedelta
from typing import Callable, List

# Seconds the whole shutdown may take; shorter after an uncaught exception, when peers are
# likely gone and waiting on them only delays the failure report.
BUDGET_S = 60.0
BUDGET_AFTER_FAILURE_S = 10.0

_owners: List[weakref.WeakMethod] = []  # bound `close`-like methods of objects that own threads
_first_steps: List[Callable[[bool], None]] = []  # e.g. stop the watchdog; run before anything else
_reports: List[Callable[[], None]] = []  # end-of-run summaries, printed before groups go away
_works: list = []  # async Work handles issued through dslaunch.runtime.comm
_groups: list = []  # process groups made by dslaunch.runtime.comm.new_group
_state = {"installed": False, "failed": False, "done": False}


def register_owner(method: Callable[[], None]) -> None:
    """`method` (bound, e.g. `self.close`) stops its object's threads; called at exit if
    the object is still alive. Held weakly: registering keeps nothing alive. It must be
    safe to call after the object was already closed."""
    _owners.append(weakref.WeakMethod(method))


def register_first(fn: Callable[[bool], None]) -> None:
    """Run `fn(failed)` first at exit (the comm package stops its watchdog this way)."""
    _first_steps.append(fn)


def register_report(fn: Callable[[], None]) -> None:
    """Run `fn` after outstanding work has finished and before the groups are destroyed."""
    _reports.append(fn)


def track_work(work) -> None:
    """An async collective's handle; waited for at exit if it is still pending."""
    prune_works()
    _works.append(work)


def prune_works() -> None:
    """Let go of the handles that have completed (a Work keeps its tensors alive)."""
    if _works:
        _works[:] = [w for w in _works if not _completed(w)]


def track_group(group) -> None:
    _groups.append(group)


def forget_group(group) -> None:
    _groups[:] = [g for g in _groups if g is not group]


def _completed(work) -> bool:
    try:
        return work.is_completed()
    except Exception:  # a handle whose group was destroyed: nothing left to wait for
        return True


# The dslaunch supervisor gives each worker the write end of a pipe and names its fd here.
# The same name is launcher/supervisor.ORIGIN_FD_VAR (the launcher does not import torch).
ORIGIN_FD_VAR = "DSLAUNCH_ORIGIN_FD"
_origin = {"fd": None}


def _take_origin_fd() -> None:
    """Keep the supervisor's pipe for this process only: the variable leaves the environment
    and the fd is not inherited across exec, so no program this worker starts can write to
    whatever that fd number means there."""
    raw = os.environ.pop(ORIGIN_FD_VAR, None)
    if not raw:
        return
    try:
        fd = int(raw)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return
    _origin["fd"] = fd


def _announce_origin(exc_type) -> None:
    """Tell the supervisor, before the traceback is printed and long before this process's
    exit tears down its process groups (which is what makes peers fail with "Connection
    closed by peer"), that this rank raised: the launcher then names this rank, whatever
    order the exits are seen in. Ctrl-C reaches every rank at once: not an origin."""
    fd, _origin["fd"] = _origin["fd"], None
    if fd is None or issubclass(exc_type, KeyboardInterrupt):
        return
    try:
        os.write(fd, f"raised {exc_type.__name__}\n".encode())
    except OSError:
        pass


def _note_failure(previous):
    def hook(exc_type, exc, tb):
        _state["failed"] = True
        _announce_origin(exc_type)
        previous(exc_type, exc, tb)

    return hook


def install() -> None:
    """Register the exit handler once per process (idempotent)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    _take_origin_fd()
    sys.excepthook = _note_failure(sys.excepthook)
    atexit.register(_at_exit)


def _say(msg: str) -> None:
    try:
        print(f"dslaunch.runtime: {msg}", file=sys.__stderr__, flush=True)
    except Exception:
        pass


def _run(step: str, fn: Callable[[], None]) -> None:
    # one misbehaving step must not keep the process groups from being destroyed
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported, shutdown goes on
        if _state["failed"]:
            # After an uncaught exception, peers that stopped waiting for this rank make the
            # outstanding collectives fail ("Connection closed by peer"): a consequence of the
            # traceback already printed, not news, and it would read as a second error.
            return
        _say(f"shutdown: {step} failed: {type(exc).__name__}: {exc}")


def _wait_works(timeout_s: float) -> None:
    pending = [w for w in _works if not _completed(w)]
    _works.clear()
    for w in pending:
        w.wait(timeout=timedelta(seconds=timeout_s))


def _sync_device() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _destroy_groups() -> None:
    import torch.distributed as dist

    from . import shm, shm_p2p

    shm.forget_all()
    shm_p2p.forget_all()
    groups, _groups[:] = list(reversed(_groups)), []
    if not (dist.is_available() and dist.is_initialized()):
        _dead_groups.extend(groups)
        return  # the script destroyed them (and with the default group, every other)
    # every group torch knows of, the script's own new_group()s included
    known = list(getattr(dist.distributed_c10d._world, "pg_map", {}).keys())
    world = dist.group.WORLD
    for g in groups:
        if g is world:
            continue  # destroyed last, with every other group
        try:
            dist.destroy_process_group(g)
        except ValueError:
            pass  # already destroyed by the script
    dist.destroy_process_group()
    _dead_groups.extend(groups + known)


_dead_groups: list = []  # destroyed groups whose remaining references are dropped next


def _drop_references_to_destroyed_groups() -> None:
    """A destroyed gloo group keeps its threads until the Python object is freed, and the
    engine, a pipeline grid or a ZeRO parameter still holds it (a module-level `engine`
    lives until finalisation). The groups are dead: every attribute, dict value, list item
    or closure cell that still refers to one becomes None, so the last reference goes now
    and the backend joins its threads while the interpreter is whole."""
    dead = {id(g): g for g in _dead_groups}
    _dead_groups.clear()
    for g in dead.values():
        for holder in gc.get_referrers(g):
            if holder is dead or isinstance(holder, (tuple, type(sys._getframe()))):
                continue
            _unlink(holder, g)
    dead.clear()


def _unlink(holder, g) -> None:
    if isinstance(holder, dict):
        for key in [k for k, v in holder.items() if v is g]:
            holder[key] = None
    elif isinstance(holder, list):
        holder[:] = [None if v is g else v for v in holder]
    elif type(holder).__name__ == "cell":
        holder.cell_contents = None
    else:  # an object whose attributes gc reports without their dict (inline values, slots)
        names = list(getattr(holder, "__dict__", {}))
        names += [n for c in type(holder).__mro__ for n in getattr(c, "__slots__", ())]
        for name in names:
            try:
                if getattr(holder, name, None) is g:
                    object.__setattr__(holder, name, None)
            except (AttributeError, TypeError):
                pass  # a read-only attribute: nothing we may change


def _release_captured_groups() -> None:
    """torch.distributed.nn.functional declares `group=group.WORLD` defaults, evaluated
    when it is imported; torch.optim imports it (through torch._dynamo), so once an
    optimizer is built after init_process_group, ten function defaults hold the default
    group for good and destroy_process_group() cannot free it: its gloo threads would live
    on into finalisation. Destroyed groups held as defaults by torch.distributed functions
    become None, which those functions read as the default group anyway."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return  # a live default group is legitimately referenced
    pg_type = dist.ProcessGroup
    for name, module in list(sys.modules.items()):
        if not name.startswith("torch.distributed") or module is None:
            continue
        for fn in list(vars(module).values()):
            defaults = getattr(fn, "__defaults__", None) if callable(fn) else None
            if defaults and any(isinstance(d, pg_type) for d in defaults):
                fn.__defaults__ = tuple(None if isinstance(d, pg_type) else d for d in defaults)


def orderly_shutdown(budget_s: float | None = None) -> None:
    """The exit sequence (see the module docstring). Safe to call more than once and
    before exit (test harnesses do); later calls find nothing left to do."""
    if _state["done"]:
        return
    _state["done"] = True
    if budget_s is None:
        budget_s = BUDGET_AFTER_FAILURE_S if _state["failed"] else BUDGET_S
    # A C thread, not a Python one: it works during finalisation and while the main
    # thread is blocked inside a backend.
    faulthandler.dump_traceback_later(budget_s, exit=True, file=sys.__stderr__)
    try:
        for fn in _first_steps:
            _run("stopping the watchdog", lambda: fn(_state["failed"]))
        for ref in list(_owners):
            method = ref()
            if method is not None:
                _run(f"closing {type(method.__self__).__name__}", method)
        _owners.clear()
        _run("waiting for outstanding collectives", lambda: _wait_works(budget_s))
        _run("waiting for the device", _sync_device)
        if not _state["failed"]:
            for fn in _reports:
                _run("printing the end-of-run report", fn)
        _run("destroying process groups", _destroy_groups)
        _run("releasing destroyed groups", _release_captured_groups)
        _run("dropping references to destroyed groups", _drop_references_to_destroyed_groups)
        gc.collect()  # groups held only by garbage cycles: join their threads now
    finally:
        faulthandler.cancel_dump_traceback_later()


def _at_exit() -> None:
    if "torch" not in sys.modules:
        return
    orderly_shutdown()


def reset_for_tests() -> None:
    """Allow orderly_shutdown to run again (unit tests drive it in one process)."""
    _state["done"] = False
