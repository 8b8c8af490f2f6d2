"""Make the FPDT layout fixture tests/data/ds_fpdt/expected.json with real DeepSpeed.

    /work/ds-venv/bin/python scripts/make_ds_fpdt_fixtures.py     # a Python with deepspeed 0.19.8

Runs `deepspeed.sequence.fpdt_layer.FPDT_InputConstruct(...).generate()` (CPU, one process)
on integer tensors whose values are their positions, for several sequence-parallel sizes,
chunk sizes and batch sizes, and records every rank's five outputs as lists.
tests/runtime/sequence/test_sequence_mpu_fpdt.py lays out the same inputs with dslaunch's
module and compares. DeepSpeed is run, never imported by the project.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_fpdt")
# (sequence length, sp size, ds_sequence_parallel_fpdt_chunk_size, batch)
CASES = [(32, 2, 8, 2), (32, 4, 16, 1), (48, 2, 12, 2), (64, 4, 8, 1), (16, 2, 16, 3)]


def inputs(seq, batch):
    """tokens, labels, loss_mask, attention_mask, position_ids: distinct values per position."""
    import torch

    tokens = torch.arange(batch * seq).reshape(batch, seq)
    return tokens, tokens + 1000, tokens % 3, torch.ones(batch, 1, seq, seq).tril().long(), tokens * 2


def main() -> None:
    try:
        from deepspeed.sequence.fpdt_layer import FPDT_InputConstruct
        import deepspeed
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    cases = []
    for seq, sp, chunk, batch in CASES:
        args = type("Args", (), {"ds_sequence_parallel_fpdt_chunk_size": chunk})()
        ranks = []
        for rank in range(sp):
            out = FPDT_InputConstruct(*inputs(seq, batch), args, sp, rank).generate()
            ranks.append([None if t is None else t.tolist() for t in out])
        cases.append({"seq": seq, "sp": sp, "chunk": chunk, "batch": batch, "ranks": ranks})
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases}, fh)
    print(f"{len(cases)} cases written", flush=True)


if __name__ == "__main__":
    main()
