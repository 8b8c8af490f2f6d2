"""Make the torch_autocast fixture tests/data/ds_autocast/expected.json with real DeepSpeed.

    /work/ds-venv/bin/python scripts/make_ds_autocast_fixtures.py     # a Python with deepspeed 0.19.8

Trains tests/autocast_workload.py's network (CPU, gloo, one rank, ZeRO 0, SGD) under
DeepSpeed's engine with `torch_autocast` enabled in bf16, and records the losses, whether
autocast was on inside the forward with the dtype a Linear gave, and
`deepspeed.runtime.torch_autocast.get_comm_dtype` of every parameter.
tests/runtime/train/test_torch_autocast_module.py runs the same under dslaunch and compares.
DeepSpeed is run, never imported by the project.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
OUT = os.path.join(TESTS, "data", "ds_autocast")
CASES = {"bf16": {"enabled": True, "dtype": "bfloat16"}, "off": {"enabled": False}}


def worker(rank, world, port, job, out):
    from bench_ranks import start_rank, write_result

    deepspeed, _ = start_rank(rank, world, port, as_peer=True, cuda=False)
    from deepspeed.runtime import torch_autocast

    sys.path.insert(0, TESTS)
    import autocast_workload

    write_result(out, rank, {name: autocast_workload.train(deepspeed, torch_autocast, conf)
                             for name, conf in CASES.items()})


def main() -> None:
    try:
        import deepspeed
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    from bench_ranks import spawn
    import tempfile

    # DeepSpeed builds its CPU shared-memory comm op at init_distributed: a folder of our own,
    # so a build for another DeepSpeed source in the shared cache cannot be picked up
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "ds-autocast-fixture-ext"))
    result = spawn(worker, 1, {})[0]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "cases": result}, fh, indent=1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
