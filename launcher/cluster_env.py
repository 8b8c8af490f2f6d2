"""Per-rank shim for `--launcher openmpi` / `--launcher slurm`: map the tool's rank
variables to dslaunch's worker contract, then exec the worker in place.

    python -m dslaunch.launcher.cluster_env [--node_sizes 2,2] [--local_rank_at I] -- python -u train.py --lr 1

mpirun and srun start every rank themselves and describe it in their own variables;
workers written for dslaunch (or torchrun, or DeepSpeed) read RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK. The shim also sets what a node agent would
(DSLAUNCH_ACCELERATOR, OMP_NUM_THREADS), since no agent runs on these hosts. exec keeps the pid, so the tool's own
signal handling and exit-code reporting reach the worker directly.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional

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


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    insert_at = None
    node_sizes = None
    while len(args) > 1 and args[0] in ("--local_rank_at", "--node_sizes"):
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
        os.execvp(args[0], args)
    except OSError as exc:
        print(f"dslaunch cluster_env: cannot run {args[0]}: {exc.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
