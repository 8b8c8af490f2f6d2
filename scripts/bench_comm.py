"""Collectives of one host's ranks: gloo against dslaunch's shared-memory transport, side by side.

    python scripts/bench_comm.py [--nprocs 2] [--numel 693000] [--rounds 60]

Starts --nprocs local ranks (gloo, one thread each). Each op runs through
dslaunch.runtime.comm with DSLAUNCH_SHM_COMM=0 (gloo) and =1 (runtime/core/comm/shm.py), the two
alternating round by round so load falls on both alike, every round after a barrier;
rank 0 prints the median and the minimum of each, and gloo's median over the segment's.
The ops are those ZeRO runs: all_reduce of --numel float32 (stage 0's bucket), reduce of
each half to its owner (stage 1-2's bucket), all_gather_into_tensor of the halves (their
parameters), reduce_scatter_tensor, an even all_to_all_single of 512 KiB (an MoE layer's
dispatch of 8 x 64 tokens x 256 wide, or a Ulysses head exchange), and an all_reduce of one
scalar (the gradient norm; below the transport's 32 KiB floor, so both columns are gloo).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from bench_timing import free_port, median  # noqa: E402  (scripts/: the timing helpers every benchmark shares)


def ops(comm, numel: int, world: int, rank: int):
    import torch

    torch.manual_seed(rank)
    full, part = torch.randn(numel), torch.randn(numel // world)
    out, rs = torch.empty(world * (numel // world)), torch.empty(numel // world)
    n = numel // world
    tokens = torch.randn(world * (131072 // world))  # 512 KiB of float32
    routed = torch.empty_like(tokens)

    def reduce_halves():
        for owner in range(world):
            comm.reduce(full[owner * n:(owner + 1) * n], group_dst=owner, group=None)

    return {
        f"all_reduce {numel * 4 / 2**20:.1f} MiB": lambda: comm.all_reduce(full, group=None),
        f"reduce to each owner ({world} x {n * 4 / 2**20:.1f} MiB)": reduce_halves,
        f"all_gather_into_tensor {n * 4 / 2**20:.1f} MiB each": lambda: comm.all_gather_into_tensor(out, part, group=None),
        f"reduce_scatter_tensor {numel * 4 / 2**20:.1f} MiB": lambda: comm.reduce_scatter_tensor(rs, full[:world * n],
                                                                                                 group=None),
        f"all_to_all_single {tokens.numel() * 4 / 2**10:.0f} KiB": lambda: comm.all_to_all_single(routed, tokens,
                                                                                                group=None),
        "all_reduce of one scalar": lambda: comm.all_reduce(torch.zeros(()), group=None),
    }


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from dslaunch.runtime import comm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    times = {}
    for name, fn in ops(comm, args.numel, world, rank).items():
        for mode in ("0", "1"):  # set up the segment and warm both paths
            os.environ["DSLAUNCH_SHM_COMM"] = mode
            for _ in range(5):
                fn()
        for _ in range(args.rounds):
            for mode in ("0", "1"):
                os.environ["DSLAUNCH_SHM_COMM"] = mode
                dist.barrier()
                t = time.perf_counter()
                fn()
                times.setdefault((name, mode), []).append(time.perf_counter() - t)
    if rank == 0:
        print(f"{'op':44} {'gloo ms':>8} {'(min)':>7} {'shm ms':>8} {'(min)':>7} {'gloo/shm':>9}")
        for name in dict.fromkeys(k for k, _ in times):
            g, s = times[(name, "0")], times[(name, "1")]
            gm, sm = median(g) * 1e3, median(s) * 1e3
            print(f"{name:44} {gm:8.2f} {min(g) * 1e3:7.2f} {sm:8.2f} {min(s) * 1e3:7.2f} {gm / sm:9.1f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--numel", type=int, default=693_000)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    port = free_port()
    print(f"bench_comm: {args.nprocs} ranks, one thread each; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    procs = []
    for r in range(args.nprocs):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.nprocs), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-main",
                                       "--numel", str(args.numel), "--rounds", str(args.rounds)], env=env))
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
