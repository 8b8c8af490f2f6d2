"""Test worker: tests/zeropp_workload.py's model under one ZeRO++ case, launched by `dslaunch
--hostfile` on the namespace cluster (2 hosts x 2 ranks, real TCP between hosts).

    zeropp_cluster.py CASE OUT

Trains the case with the comms logger on and writes, from rank 0, the bytes between hosts the
traffic report counted (all, backward all-gathers) and, per host, the bytes its eth0 sent
during training (/proc/net/dev is per network namespace: only traffic between hosts leaves by
eth0) to OUT.json.
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
case, out = work.CASES[args[0]], args[1]
deepspeed.init_distributed("gloo")
rank = dist.get_rank()
dist.barrier()
before = eth0_tx()
result = work.run_case(deepspeed, case, rank, comms_logger=True)
dist.barrier()
sent = eth0_tx() - before
report = comm.traffic_report()
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, (os.environ["NODE_RANK"], int(os.environ["LOCAL_RANK"]), sent))
if rank == 0:
    result.update(inter=report.inter_host_bytes(), backward_gather=report.inter_host_bytes("backward", "all_gather"),
                  wire=sum(s for _, local, s in everyone if local == 0))
    Path(out).write_text(json.dumps(result))
