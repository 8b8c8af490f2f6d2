"""Demo/benchmark worker: join the gloo group dslaunch set up and all_reduce each rank's number.

Rank r contributes r + 1, so every rank must print WORLD_SIZE*(WORLD_SIZE+1)/2.
"""
import os
import sys

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    print(f"all_reduce sum = {t.item():g} (expected {expected:g}) on rank {rank} of {world}, "
          f"local rank {os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()
    return 0 if t.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
