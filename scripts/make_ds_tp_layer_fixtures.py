"""Make tests/data/ds_tp_layers.json with real DeepSpeed (0.19.8, CPU): how its AutoTP training
layers `LinearLayer` (column parallel) and `LinearAllreduce` (row parallel) cut a full
nn.Linear for each rank of a tensor-parallel group, uneven sizes included.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_tp_layer_fixtures.py

One process, no process group: each layer is built with mp_group=None (tp 1, nothing cut),
then given the group's size and a rank by hand and re-cut with its own `_freeze_partition_sizes`
and `_tp_partition`, as DeepSpeed's own unit tests do. The full weights are `arange` values, so
the recorded shards say exactly which rows or columns each rank keeps.
Recorded per case: the partition sizes, and each rank's weight and bias shard (as lists).
tests/runtime/tensor_parallel/test_tp_ds_layers.py replays our side.
"""
from __future__ import annotations

import json
import os
import sys

import torch

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "ds_tp_layers.json")

# (kind, in_features, out_features, tp, layer name)
CASES = [("column", 4, 11, 2, None), ("column", 3, 10, 3, "lm_head"), ("column", 2, 129, 4, None),
         ("column", 3, 8, 2, None), ("row", 11, 3, 2, None), ("row", 8, 2, 4, None), ("row", 10, 2, 3, None)]


def full_linear(fin: int, fout: int) -> torch.nn.Linear:
    lin = torch.nn.Linear(fin, fout)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(fout * fin, dtype=torch.float32).view(fout, fin))
        lin.bias.copy_(torch.arange(fout, dtype=torch.float32) + 1000)
    return lin


def main() -> int:
    from deepspeed.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode
    set_autotp_mode(training=True)
    cases = []
    for kind, fin, fout, tp, name in CASES:
        cls = LinearLayer if kind == "column" else LinearAllreduce
        ranks = []
        sizes = None
        for rank in range(tp):
            layer = cls(full_linear(fin, fout), mp_group=None, name=name)
            layer.tp_world_size, layer.tp_index = tp, rank
            sizes = layer._freeze_partition_sizes(fout if kind == "column" else fin)
            layer._tp_partition([layer.weight, layer.bias])
            ranks.append({"weight": layer.weight.detach().tolist(), "bias": layer.bias.detach().tolist()})
        cases.append({"kind": kind, "in": fin, "out": fout, "tp": tp, "name": name, "sizes": list(sizes),
                      "ranks": ranks})
    import deepspeed
    with open(OUT, "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {os.path.normpath(OUT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
