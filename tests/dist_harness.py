"""Run a function or a script on N local processes (gloo) and collect per-rank results.

    results = run_function(my_test_body, nprocs=2, kwargs={...}, timeout=120)
    runs = run_script(["script.py", "--flag"], nprocs=2, timeout=120)

`run_function` executes `fn(**kwargs)` in N Python processes with RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set and a gloo process group already initialised
(nccl, one GPU per rank, with DSLAUNCH_TEST_BACKEND=nccl; pass init_process_group=False to skip that); `fn` must be a module-level function of an
importable file (a test module is fine: it is loaded by path). It returns the list of the
per-rank return values (anything picklable), in rank order.

`run_script` runs a Python script the same way (no process group: the script makes its
own) and returns a list of `RankRun(returncode, stdout, stderr)`.

Each rank is forked from a warm interpreter that has imported torch once for the session
(warm_ranks.py says what a rank sees and why it is the same as a fresh process), which takes
about 5 s of CPU off every rank; DSLAUNCH_TEST_FORK=0 starts fresh interpreters instead.

Watchdog: if the ranks have not all finished within `timeout` seconds, each rank is asked
for the Python stack of every thread (faulthandler on SIGUSR1), all are killed, and
`DistHang` is raised with those stacks, so a hung collective fails fast and says where.
If one rank fails, the others are killed at once (they would otherwise wait forever in
a collective) and `RankFailed` carries the failing rank's stderr.

Shutdown: like the runtime (dslaunch.runtime.comm.shutdown), every rank tears down in
order before the interpreter finalises: after `fn` returns (and, for scripts, at exit) it
runs the runtime's orderly shutdown when the runtime was imported (runtime threads
stopped, outstanding collectives waited for, groups destroyed), and otherwise destroys
whatever process group is left, then collects garbage so the backend threads are joined
while Python is whole. Without this a rank can exit with SIGABRT ("terminate called
without an active exception") after finishing its work.

Running this file directly is the worker side; it is not meant to be invoked by hand.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import warm_ranks

HERE = os.path.abspath(__file__)
# The dslaunch command as the tests start it: this interpreter's, whatever PATH holds.
DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher"]


class DistHang(AssertionError):
    pass


class RankFailed(AssertionError):
    pass


@dataclass
class RankRun:
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    # every address, as the rank-0 TCPStore listens (see runtime/core/comm/backend.py _free_port)
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# A port is free when free_port() looks, and rank 0's store binds it a second or more later
# (after importing torch): another program on the machine may take it in between. That is
# the machine, not the code under test, so such a run is started again on a new port.
PORT_TRIES = 3
_PORT_TAKEN = "The server socket has failed to listen on any local network address"


def _port_taken(runs: List["RankRun"]) -> bool:
    return bool(runs) and runs[0].returncode != 0 and _PORT_TAKEN in runs[0].stderr and \
        ("EADDRINUSE" in runs[0].stderr or "address already in use" in runs[0].stderr)


def _on_a_free_port(start: Callable[[int], List["RankRun"]]) -> List["RankRun"]:
    for _ in range(PORT_TRIES - 1):
        runs = start(free_port())
        if not _port_taken(runs):
            return runs
    return start(free_port())


def _rank_env(rank: int, nprocs: int, port: int, extra: Optional[Dict[str, str]]) -> Dict[str, str]:
    # The caller's variables first, the rendezvous last: an `extra` copied from os.environ may
    # carry RANK, WORLD_SIZE and MASTER_PORT that a one-process init_distributed earlier in this
    # pytest process set (its store may still hold that port), and they must not win.
    env = dict(os.environ)
    if extra:
        env.update(extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONFAULTHANDLER="1")
    return env


def _supervise(cmds: List[List[str]], envs: List[Dict[str, str]], timeout: float, workdir: str,
               cwd: Optional[str]) -> List[RankRun]:
    outs = [open(os.path.join(workdir, f"out{r}"), "w+") for r in range(len(cmds))]
    errs = [open(os.path.join(workdir, f"err{r}"), "w+") for r in range(len(cmds))]
    # Each rank forked from a warm interpreter that has imported torch (warm_ranks.py), or, with
    # DSLAUNCH_TEST_FORK=0 and on GPUs, a fresh one.
    warm = [warm_ranks.enabled(e) and warm_ranks.forkable(c) for c, e in zip(cmds, envs)]
    warm_ranks.prepare([e for e, w in zip(envs, warm) if w])
    procs: list = []

    def read(files, r):
        files[r].flush()
        files[r].seek(0)
        return files[r].read()

    def kill_all():
        for p in procs:
            if p.poll() is None:
                for kill in (os.killpg, os.kill):  # kill: a forked rank may not have made its group yet
                    try:
                        kill(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for p in procs:
            p.wait()

    try:
        for c, e, o, er, w in zip(cmds, envs, outs, errs, warm):
            procs.append(warm_ranks.WarmRank(c, e, o, er, cwd) if w else
                         subprocess.Popen(c, env=e, stdout=o, stderr=er, cwd=cwd, start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Give the others a moment to report their own failure, then stop them.
                grace = time.monotonic() + 2.0
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
                kill_all()
                return [RankRun(p.returncode, read(outs, r), read(errs, r)) for r, p in enumerate(procs)]
            if all(c == 0 for c in codes):
                return [RankRun(0, read(outs, r), read(errs, r)) for r in range(len(procs))]
            if time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        try:
                            os.kill(p.pid, signal.SIGUSR1)
                        except ProcessLookupError:
                            pass
                time.sleep(1.5)
                kill_all()
                report = []
                for r in range(len(procs)):
                    stack = ""
                    path = os.path.join(workdir, f"stack{r}")
                    if os.path.exists(path):
                        with open(path) as fh:
                            stack = fh.read()
                    report.append(f"--- rank {r} stack ---\n{stack or '(no stack)'}\n--- rank {r} stderr tail ---\n"
                                  f"{read(errs, r)[-2000:]}")
                raise DistHang(f"{len(procs)} ranks did not finish within {timeout:.0f} s\n" + "\n".join(report))
            time.sleep(0.02)
    finally:
        kill_all()
        for f in outs + errs:
            f.close()


def run_function(fn: Callable, nprocs: int = 2, kwargs: Optional[Dict[str, Any]] = None, timeout: float = 120,
                 env: Optional[Dict[str, str]] = None, init_process_group: bool = True) -> List[Any]:
    import inspect

    source = os.path.abspath(inspect.getfile(fn))
    with tempfile.TemporaryDirectory(prefix="dist-harness-") as workdir:
        job = os.path.join(workdir, "job.pkl")
        with open(job, "wb") as fh:
            pickle.dump({"source": source, "name": fn.__name__, "kwargs": kwargs or {},
                         "init": init_process_group}, fh)
        cmds = [[sys.executable, HERE, job, os.path.join(workdir, f"result{r}"), os.path.join(workdir, f"stack{r}")]
                for r in range(nprocs)]
        runs = _on_a_free_port(lambda port: _supervise(cmds, [_rank_env(r, nprocs, port, env) for r in range(nprocs)],
                                                       timeout, workdir, cwd=None))
        # Ranks we killed (-9) are victims; report one that failed on its own.
        bad = sorted((r for r, run in enumerate(runs) if run.returncode != 0),
                     key=lambda r: runs[r].returncode == -signal.SIGKILL)
        if bad:
            first = bad[0]
            raise RankFailed(f"rank {first} exited with {runs[first].returncode}:\n{runs[first].stderr[-4000:]}")
        results = []
        for r in range(nprocs):
            with open(os.path.join(workdir, f"result{r}"), "rb") as fh:
                results.append(pickle.load(fh))
        return results


def run_script(argv: Sequence[str], nprocs: int = 2, timeout: float = 120, env: Optional[Dict[str, str]] = None,
               cwd: Optional[str] = None) -> List[RankRun]:
    with tempfile.TemporaryDirectory(prefix="dist-harness-") as workdir:
        # this file runs the script (stack-on-SIGUSR1 handler, teardown at exit)
        cmds = [[sys.executable, HERE, "--script", os.path.join(workdir, f"stack{r}"), *argv] for r in range(nprocs)]
        return _on_a_free_port(lambda port: _supervise(cmds, [_rank_env(r, nprocs, port, env) for r in range(nprocs)],
                                                       timeout, workdir, cwd=cwd))


def teardown() -> None:
    """The orderly end of a rank (see the module docstring); idempotent."""
    import gc

    runtime_shutdown = sys.modules.get("dslaunch.runtime.core.comm.shutdown")
    if runtime_shutdown is not None:
        runtime_shutdown.orderly_shutdown()
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()


def _stacks_on_sigusr1(stack_path: str) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=open(stack_path, "w"), all_threads=True)


def _script_main(stack_path: str, argv: List[str]) -> None:
    import atexit
    import runpy

    _stacks_on_sigusr1(stack_path)
    atexit.register(teardown)  # registered first, so it runs after the script's own handlers
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would
    runpy.run_path(argv[0], run_name="__main__")


def _worker(job_path: str, result_path: str, stack_path: str) -> None:
    import importlib.util

    _stacks_on_sigusr1(stack_path)
    with open(job_path, "rb") as fh:
        job = pickle.load(fh)
    sys.path.insert(0, os.path.dirname(job["source"]))
    spec = importlib.util.spec_from_file_location(f"_dist_job_{os.getpid()}", job["source"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, job["name"])
    if job["init"]:
        import torch.distributed as dist

        # DSLAUNCH_TEST_BACKEND=nccl runs the same test on GPUs (one per rank), where there are some
        backend = os.environ.get("DSLAUNCH_TEST_BACKEND", "gloo")
        if backend == "nccl":
            import torch

            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    result = fn(**job["kwargs"])
    with open(result_path, "wb") as fh:
        pickle.dump(result, fh)
    del result
    teardown()


if __name__ == "__main__":
    if sys.argv[1] == "--script":
        _script_main(sys.argv[2], sys.argv[3:])
    else:
        _worker(*sys.argv[1:4])
