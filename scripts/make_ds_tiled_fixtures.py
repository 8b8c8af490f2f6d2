"""Make the DeepSpeed tiled-compute fixture tests/data/ds_tiled/expected.json with real DeepSpeed.

    /work/ds-venv/bin/python scripts/make_ds_tiled_fixtures.py     # a Python with deepspeed 0.19.8

Runs tests/tiled_workload.py's cases (TiledMLP, sequence_tiled_compute, TiledFusedLogitsLoss
at shard counts that do and do not divide the rows; fp32, CPU, one process) with
`deepspeed.runtime.sequence_parallel.ulysses_sp` and records each output and every gradient,
and the cases where DeepSpeed's gradients are wrong (tiled_workload.DIFFERS).
tests/runtime/sequence/test_sequence_tiled.py runs the same cases with dslaunch's module and compares. DeepSpeed
is run, never imported by the project.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
OUT = os.path.join(TESTS, "data", "ds_tiled")


def main() -> None:
    try:
        import deepspeed
        from deepspeed.runtime.sequence_parallel import ulysses_sp
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    import torch

    sys.path.insert(0, TESTS)
    import tiled_workload

    torch.set_num_threads(1)
    expected = {"deepspeed": deepspeed.__version__, "torch": torch.__version__.split("+")[0], "cases": {},
                "differs": {}}
    for key, cases in (("cases", tiled_workload.CASES), ("differs", tiled_workload.DIFFERS)):
        for name in cases:
            expected[key][name] = tiled_workload.run_case(ulysses_sp, name)
            print(f"{name}: ok", flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump(expected, fh)


if __name__ == "__main__":
    main()
