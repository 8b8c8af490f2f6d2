"""Per-rank shim for `--launcher openmpi` / `--launcher slurm`: map the tool's rank
variables to dslaunch's worker contract, then exec the worker in place.

    python -m dslaunch.launcher.cluster_env -- python -u train.py --lr 1

mpirun and srun start every rank themselves and describe it in their own variables;
workers written for dslaunch (or torchrun, or DeepSpeed) read RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE and NODE_RANK. exec keeps the pid, so the tool's own
signal handling and exit-code reporting reach the worker directly.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, Optional

# contract variable -> source variable, per tool; first tool whose RANK source is set wins
_MAPS = {
    "openmpi": {
        "RANK": "OMPI_COMM_WORLD_RANK",
        "WORLD_SIZE": "OMPI_COMM_WORLD_SIZE",
        "LOCAL_RANK": "OMPI_COMM_WORLD_LOCAL_RANK",
        "LOCAL_WORLD_SIZE": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "NODE_RANK": "OMPI_COMM_WORLD_NODE_RANK",
    },
    "slurm": {
        "RANK": "SLURM_PROCID",
        "WORLD_SIZE": "SLURM_NTASKS",
        "LOCAL_RANK": "SLURM_LOCALID",
        "NODE_RANK": "SLURM_NODEID",
    },
}


def contract_from(environ: Mapping[str, str]) -> Dict[str, str]:
    """The contract variables derived from mpirun's or srun's; {} if neither started us."""
    for tool, mapping in _MAPS.items():
        if mapping["RANK"] not in environ:
            continue
        out = {dst: environ[src] for dst, src in mapping.items() if src in environ}
        if tool == "slurm" and "LOCAL_WORLD_SIZE" not in out:
            # SLURM_TASKS_PER_NODE looks like "2(x3)" or "2,1"; our node's entry is at NODE_RANK
            per_node = _expand_slurm_counts(environ.get("SLURM_TASKS_PER_NODE", ""))
            node = int(out.get("NODE_RANK", "0"))
            if node < len(per_node):
                out["LOCAL_WORLD_SIZE"] = str(per_node[node])
        out["GROUP_RANK"] = out.get("NODE_RANK", "0")
        return out
    return {}


def _expand_slurm_counts(spec: str) -> List[int]:
    counts: List[int] = []
    for part in filter(None, spec.split(",")):
        if "(x" in part:
            n, _, rep = part.partition("(x")
            counts += [int(n)] * int(rep.rstrip(")"))
        else:
            counts.append(int(part))
    return counts


def main(argv: Optional[List[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    insert_at = None
    if args[:1] == ["--local_rank_at"] and len(args) > 1 and args[1].isdigit():
        insert_at, args = int(args[1]), args[2:]
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m dslaunch.launcher.cluster_env -- COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    contract = contract_from(os.environ)
    if not contract:
        print("dslaunch cluster_env: neither OMPI_COMM_WORLD_RANK nor SLURM_PROCID is set "
              "(run me under mpirun or srun)", file=sys.stderr)
        sys.exit(2)
    os.environ.update(contract)
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
