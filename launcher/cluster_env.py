"""Per-rank shim for `--launcher openmpi` / `--launcher slurm`: map the tool's rank
variables to dslaunch's worker contract, then exec the worker in place.

    python -m dslaunch.launcher.cluster_env [--node_sizes 2,2] [--local_rank_at I] [--whole_lines] -- python -u train.py --lr 1

mpirun and srun start every rank themselves and describe it in their own variables;
workers written for dslaunch (or torchrun, or DeepSpeed) read RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK. The shim also sets what a node agent would
(DSLAUNCH_ACCELERATOR, OMP_NUM_THREADS), since no agent runs on these hosts. exec keeps the pid, so the tool's own
signal handling and exit-code reporting reach the worker directly.

`--whole_lines` (Open MPI) trades exec for a relay: mpirun forwards each rank's output in
the chunks the rank wrote, and an unbuffered Python prints a line as two writes (the text,
then the newline), so lines of different ranks came out glued together ("sum=10 ...sum=10
...") and `--tag-output` does not help. The shim then runs the worker as its child and
passes its stdout and stderr on in whole lines, one write each; it forwards the signals
mpirun sends, the child dies with it (PR_SET_PDEATHSIG), and it ends as the child did, by
the same signal or with the same code. srun already forwards whole lines.
"""
from __future__ import annotations

import os
import sys
import signal
import threading
from typing import BinaryIO, Dict, List, Mapping, Optional

from dslaunch.launcher.allocation import expand_counts

# contract variable -> source variable, per tool; first tool whose RANK source is set wins
_MAPS = {
    "openmpi": {
        "RANK": "OMPI_COMM_WORLD_RANK",
        "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
        "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
        "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
        # not OMPI_COMM_WORLD_NODE_RANK: that is a rank among one node's processes, not the
        # node's index; the index comes from --node_sizes (node_rank_of)
    },
    "slurm": {
        "RANK": "SLURM_PROCID",
        "WORLD_SIZE": "SLURM_NTASKS",
        "LOCAL_RANK": "SLURM_LOCALID",
        "NODE_RANK": "SLURM_NODEID",
    },
}


def contract_from(environ: Mapping[str, str], node_sizes: Optional[List[int]] = None) -> Dict[str, str]:
    """The contract variables derived from mpirun's or srun's; {} if neither started us.
    node_sizes: ranks per node in rank order, where the tool does not say the node's index."""
    for tool, mapping in _MAPS.items():
        if mapping["RANK"] not in environ:
            continue
        out = {dst: environ[src] for dst, src in mapping.items() if src in environ}
        if "NODE_RANK" not in out and node_sizes:
            out["NODE_RANK"] = str(node_rank_of(int(out["RANK"]), node_sizes))
        if tool == "slurm" and "LOCAL_WORLD_SIZE" not in out:
            # SLURM_TASKS_PER_NODE looks like "2(x3)" or "2,1"; our node's entry is at NODE_RANK
            per_node = expand_counts(environ.get("SLURM_TASKS_PER_NODE", ""))
            node = int(out.get("NODE_RANK", "0"))
            if node < len(per_node):
                out["LOCAL_WORLD_SIZE"] = str(per_node[node])
        out["GROUP_RANK"] = out.get("NODE_RANK", "0")
        return out
    return {}


def node_rank_of(rank: int, node_sizes: List[int]) -> int:
    """The node holding `rank` when consecutive ranks fill the nodes in turn."""
    first = 0
    for node, size in enumerate(node_sizes):
        first += size
        if rank < first:
            return node
    raise ValueError(f"rank {rank} is beyond the {first} slots of --node_sizes")


def host_defaults(environ: Mapping[str, str], local_world_size: int) -> Dict[str, str]:
    """What the node agent sets on other backends, from this host's own facts: the
    accelerator, and an even share of the cores as OMP_NUM_THREADS unless the user set it."""
    from dslaunch.launcher.machine import detect_gpus

    out = {}
    if "DSLAUNCH_ACCELERATOR" not in environ:
        out["DSLAUNCH_ACCELERATOR"] = "cuda" if detect_gpus(environ)[0] else "cpu"
    if "OMP_NUM_THREADS" not in environ:
        out["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))
    return out


# A partial line longer than this is passed on as it is rather than held.
_HOLD_LIMIT = 1 << 16


def relay_lines(src: BinaryIO, dst_fd: int) -> None:
    """Copy src to dst_fd until EOF, each write ending at a line end (\\n or \\r, so progress
    bars redraw), the rest held until its end arrives, at EOF, or past _HOLD_LIMIT."""
    held = b""
    while True:
        chunk = src.read1(_HOLD_LIMIT) if hasattr(src, "read1") else src.read(_HOLD_LIMIT)
        if not chunk:
            break
        held += chunk
        cut = max(held.rfind(b"\n"), held.rfind(b"\r")) + 1
        if cut == 0 and len(held) > _HOLD_LIMIT:
            cut = len(held)
        if cut:
            _write_all(dst_fd, held[:cut])
            held = held[cut:]
    if held:
        _write_all(dst_fd, held)


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # the reader (mpirun's orted) is gone; the job is ending
        pass


def run_relayed(args: List[str]) -> int:
    """Run args as a child whose output reaches ours in whole lines; its exit status."""
    import subprocess

    from dslaunch.launcher.reaper import make_child_setup

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=make_child_setup(signal.SIGKILL))

    def forward(signum, frame) -> None:
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    pumps = [threading.Thread(target=relay_lines, args=(pipe, fd), daemon=True)
             for pipe, fd in ((proc.stdout, sys.stdout.fileno()), (proc.stderr, sys.stderr.fileno()))]
    for t in pumps:
        t.start()
    code = proc.wait()
    for t in pumps:
        t.join()
    return code


def _end_like(code: int) -> None:
    """Exit as the child did: by its signal (so mpirun reports the same), or with its code."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.exit(code)


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    insert_at = None
    node_sizes = None
    whole_lines = False
    while args and args[0] == "--whole_lines" or len(args) > 1 and args[0] in ("--local_rank_at", "--node_sizes"):
        if args[0] == "--whole_lines":
            whole_lines, args = True, args[1:]
            continue
        flag, value, args = args[0], args[1], args[2:]
        try:
            if flag == "--local_rank_at":
                insert_at = int(value)
            else:
                node_sizes = [int(n) for n in value.split(",")]
        except ValueError:
            print(f"dslaunch cluster_env: {flag} {value!r}: not a number (list)", file=sys.stderr)
            sys.exit(2)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m dslaunch.launcher.cluster_env -- COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    try:
        contract = contract_from(os.environ, node_sizes)
    except ValueError as exc:
        print(f"dslaunch cluster_env: {exc}", file=sys.stderr)
        sys.exit(2)
    if not contract:
        print("dslaunch cluster_env: neither OMPI_COMM_WORLD_RANK nor SLURM_PROCID is set "
              "(run me under mpirun or srun)", file=sys.stderr)
        sys.exit(2)
    os.environ.update(contract)
    os.environ.update(host_defaults(os.environ, int(contract.get("LOCAL_WORLD_SIZE", "1"))))
    if insert_at is not None:
        # DeepSpeed-style scripts take --local_rank; only now is this rank's value known
        args.insert(insert_at, f"--local_rank={contract.get('LOCAL_RANK', '0')}")
    try:
        if whole_lines:
            _end_like(run_relayed(args))
        os.execvp(args[0], args)
    except OSError as exc:
        print(f"dslaunch cluster_env: cannot run {args[0]}: {exc.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
