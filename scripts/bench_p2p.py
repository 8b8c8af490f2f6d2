"""Point-to-point between two ranks of one host: gloo against dslaunch's shared-memory rings.

    python scripts/bench_p2p.py [--sizes 8 64 1024 8192] [--rounds 40]

Starts 2 local ranks (gloo, one thread each). Each size (KiB of float32) makes a round trip
through dslaunch.runtime.comm: rank 0 sends, rank 1 receives and sends it back, rank 0
receives (a pipeline's activation and its gradient). One tag's flows were set up with
comm.connect_same_host_p2p (rings: runtime/core/comm/shm_p2p.py), another's were not
(gloo), and the two alternate round by round after a barrier so load falls on both alike.
The table gives rank 0's median and minimum round trip of each, and gloo's median over the rings'.
8 KiB is the activation of a 16-row micro-batch of width 128 (scripts/bench_pipeline.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ranks import spawn, start_rank, write_result  # noqa: E402  (scripts/: the rank start benchmarks share)
from bench_timing import median  # noqa: E402

RING_TAG, GLOO_TAG = 1, 2


def rank_main(rank: int, world: int, port: int, args, result_path: str) -> None:
    """One of the two ranks: its round trips per size and tag, in seconds, as the result."""
    import torch
    import torch.distributed as dist

    rt, _ = start_rank(rank, world, port, as_peer=False, cuda=False)
    comm = rt.comm
    peer = 1 - rank
    group = comm.get_world_group()
    flows = comm.connect_same_host_p2p(group, [(peer, RING_TAG)], [(peer, RING_TAG)])
    if rank == 0:
        print(f"ring flows: {flows}", flush=True)

    def round_trip(t, buf, tag):
        if rank == 0:
            comm.send(t, peer, group=group, tag=tag, label="bench")
            comm.recv(buf, peer, group=group, tag=tag, label="bench")
        else:
            comm.recv(buf, peer, group=group, tag=tag, label="bench")
            comm.send(buf, peer, group=group, tag=tag, label="bench")
        comm.wait_p2p_sends()

    times = {}
    for kib in args.sizes:
        t = torch.randn(kib * 256)
        buf = torch.empty_like(t)
        for tag in (GLOO_TAG, RING_TAG):
            for _ in range(3):
                round_trip(t, buf, tag)
        for _ in range(args.rounds):
            for tag in (GLOO_TAG, RING_TAG):
                dist.barrier()
                start = time.perf_counter()
                round_trip(t, buf, tag)
                times.setdefault(f"{kib} {tag}", []).append(time.perf_counter() - start)
        if rank == 0 and not torch.equal(buf, t):
            raise SystemExit(f"bench_p2p: the {kib} KiB round trip came back different")
    dist.barrier()
    write_result(result_path, rank, times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 1024, 8192])
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    print(f"bench_p2p: 2 ranks, one thread each; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    times = spawn(rank_main, 2, args)[0]  # rank 0's clock: it starts and ends each round trip
    print(f"{'KiB':>6} {'gloo ms':>8} {'(min)':>7} {'ring ms':>8} {'(min)':>7} {'gloo/ring':>10}")
    for kib in args.sizes:
        g, s = times[f"{kib} {GLOO_TAG}"], times[f"{kib} {RING_TAG}"]
        gm, sm = median(g) * 1e3, median(s) * 1e3
        print(f"{kib:6d} {gm:8.3f} {min(g) * 1e3:7.3f} {sm:8.3f} {min(s) * 1e3:7.3f} {gm / sm:10.1f}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
