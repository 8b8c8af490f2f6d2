"""The plumbing the multi-rank scripts share (the benchmarks bench_tp, bench_moe,
bench_pipeline, and the make_ds_*_fixtures scripts): start `world` local ranks, each importing
our runtime or, as the peer, DeepSpeed; collect every rank's JSON result; and run the same
file under DeepSpeed's Python so the two sides take turns on one machine."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from bench_timing import free_port  # noqa: F401  (the make_ds_*_fixtures scripts take it from here too)


def rank_env(rank: int, world: int, port: int, **more: str) -> None:
    """Inside a rank: the environment the launcher gives one local rank (`more`: other
    variables a script needs too)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), **more)


def start_rank(rank: int, world: int, port: int, as_peer: bool, cuda: bool) -> Tuple[object, torch.device]:
    """Inside a spawned rank: the launcher's environment, one CPU thread (each rank should own
    a core), the runtime module (`deepspeed` for the peer) with its process group started,
    and the rank's device."""
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    rt = importlib.import_module("deepspeed" if as_peer else "dslaunch.runtime")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rt.init_distributed("nccl" if cuda else "gloo")
    return rt, device


def write_result(result_path: str, rank: int, out) -> None:
    with open(f"{result_path}.{rank}", "w") as fh:
        json.dump(out, fh)


def spawn(worker: Callable, world: int, args) -> List:
    """[rank] -> result: `worker(rank, world, port, args, result_path)` in `world` fresh
    processes, each writing its result with write_result()."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result")
        mp.spawn(worker, args=(world, port, args, path), nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(f"{path}.{r}") as fh:
                results.append(json.load(fh))
        return results


def run_script_ranks(python: str, script: str, job: dict, world: int, cwd: str, timeout: float = 600,
                     quiet: bool = False, capture: bool = False):
    """`python script --worker RANK JOB` for each of `world` ranks, JOB the job as JSON plus a
    free `port` and the `result` path rank 0 writes its JSON to; returns that JSON. A failure
    stops the script, or with capture returns the last line rank 0 wrote to stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        job = dict(job, port=free_port(), result=os.path.join(tmp, "result.json"))
        err = [open(os.path.join(tmp, f"err{r}"), "w+") if capture else None for r in range(world)]
        procs = [subprocess.Popen([python, script, "--worker", str(r), json.dumps(job)], cwd=cwd, stderr=err[r],
                                  stdout=subprocess.DEVNULL if quiet else None) for r in range(world)]
        codes = [p.wait(timeout=timeout) for p in procs]
        if any(codes):
            if capture:
                err[0].seek(0)
                lines = [ln.strip() for ln in err[0].read().splitlines() if ln.strip()]
                return lines[-1] if lines else f"exit codes {codes}"
            raise SystemExit(f"{os.path.basename(script)} {job}: exit codes {codes}")
        with open(job["result"]) as fh:
            return json.load(fh)


# -- inside a rank of run_script_ranks (a make_ds_*_fixtures script run as `--worker RANK JOB`) --
def script_main(worker: Callable[[int, dict], None], main: Callable[[], object]) -> None:
    """A script's entry: `--worker RANK JOB` (as run_script_ranks starts each rank) runs
    worker(rank, job); anything else runs main()."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        main()


def script_rank(rank: int, job: dict, deepspeed_only: bool = False):
    """The start of a worker rank: the environment for job["world"] ranks on job["port"], and
    the runtime it trains with: DeepSpeed, its gloo process group started, where job["engine"]
    is "deepspeed" (every job where `deepspeed_only`); else dslaunch.runtime, which starts its
    group at initialize."""
    rank_env(rank, job["world"], job["port"])
    if deepspeed_only or job["engine"] == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        return deepspeed
    return importlib.import_module("dslaunch.runtime")


def finish_script_rank(rank: int, job: dict, result) -> None:
    """The end of a worker rank: rank 0 writes `result` to job["result"] as JSON (what
    run_script_ranks returns), then every rank waits for the others, so that none leaves
    the process group while another still uses it."""
    import torch.distributed as dist

    if rank == 0:
        with open(job["result"], "w") as fh:
            json.dump(result, fh)
    dist.barrier(group=dist.group.WORLD)


def run_peer(python: str, script: str, argv: Sequence[str], cache_name: str) -> dict:
    """`script --as-peer OUT argv...` under DeepSpeed's Python; its JSON, or {"error": the last
    line it printed}."""
    env = dict(os.environ)
    # a private extension cache: DeepSpeed builds its CPU comm op at start-up, and a build
    # killed in the shared default cache leaves a lock every later start waits on forever
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), cache_name))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([python, os.path.abspath(script), "--as-peer", out.name, *argv], env=env,
                              capture_output=True, text=True)
        if proc.returncode:
            err = proc.stderr.strip()
            return {"error": err.splitlines()[-1] if err else f"exit {proc.returncode}"}
        with open(out.name) as fh:
            return json.load(fh)


def take_turns(rounds: int, ours: Callable[[], object], peer: Optional[Callable[[], dict]],
               best: Callable[[list], object], best_peer: Optional[Callable[[list], dict]] = None
               ) -> Tuple[object, Optional[dict]]:
    """Run our side and the peer `rounds` times each, alternating, so load from elsewhere falls
    on both; returns (best(our runs), best_peer (default best) of the peer runs that ran), the
    peer's as its first {"error": ...} when none ran, or None without a peer."""
    mine, theirs = [], []
    for _ in range(rounds):
        mine.append(ours())
        if peer is not None:
            theirs.append(peer())
    ok = [r for r in theirs if "error" not in r]
    return best(mine), ((best_peer or best)(ok) if ok else (theirs[0] if theirs else None))


def mib(n: float, digits: int = 2) -> str:
    return f"{n / 2 ** 20:.{digits}f}"
