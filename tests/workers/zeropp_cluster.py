"""Test worker: tests/zeropp_workload.py's model under ZeRO++ cases, one after the other in one
job launched by `dslaunch --hostfile` on the namespace cluster (2 hosts x 2 ranks, real TCP
between hosts).

    zeropp_cluster.py OUT CASE [CASE ...]

Trains each case with the comms logger on and writes, from rank 0, OUT.json: per case its
losses, the bytes between hosts the traffic report counted (all; the all-gathers of forward
and of backward; the gradients' reduce-scatters and all-to-alls) and the bytes the hosts'
eth0 sent while it trained (/proc/net/dev is per network namespace: only traffic between
hosts leaves by eth0; summed over the hosts, read by each host's local rank 0).
"""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeropp_workload as work  # noqa: E402

import dslaunch.runtime as deepspeed  # noqa: E402
from dslaunch.runtime import comm  # noqa: E402


def eth0_tx() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            return int(rest.split()[8])
    return 0


args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
out, names = args[0], args[1:]
deepspeed.init_distributed("gloo")
rank = dist.get_rank()
results = {}
for name in names:
    comm.reset_log()
    dist.barrier()
    before = eth0_tx()
    result = work.run_case(deepspeed, work.CASES[name], rank, comms_logger=True)
    dist.barrier()
    sent = eth0_tx() - before
    report = comm.traffic_report()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (int(os.environ["LOCAL_RANK"]), sent))
    result.update(inter=report.inter_host_bytes(),
                  forward_gather=report.inter_host_bytes("forward", "all_gather"),
                  backward_gather=report.inter_host_bytes("backward", "all_gather"),
                  grads=report.inter_host_bytes("backward", "reduce_scatter")
                  + report.inter_host_bytes("backward", "all_to_all"),
                  wire=sum(s for local, s in everyone if local == 0))
    results[name] = result
comm.configure(enabled=False)
if rank == 0:
    Path(out).write_text(json.dumps(results))
