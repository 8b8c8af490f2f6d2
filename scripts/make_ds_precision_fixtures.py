"""Make the precision fixture tests/data/ds_precision/expected.json with real DeepSpeed.

    /work/ds-venv/bin/python scripts/make_ds_precision_fixtures.py     # a Python with deepspeed 0.19.8

Runs tests/precision_workload.py under DeepSpeed's engine (CPU, gloo) and records:
- "cases": one rank trained under each fp16/bf16 module-cast case (data_types.buffer_dtype,
  param_dtype, keep_in_fp32_modules, ZeRO 0-3): the losses and the dtype of every buffer and
  parameter after initialize;
- "accumulation": two ranks at ZeRO 1, bf16, grad_accum_dtype fp32, with
  bf16.immediate_grad_update unset, false and true: each rank's losses;
- "zero_init": the buffer dtypes of a model built inside zero.Init under a bf16 config (after
  Init and after initialize) and of one partitioned by Init(module=...).
tests/runtime/train/test_precision_vs_deepspeed.py runs the same under dslaunch and compares.
DeepSpeed is run, never imported by the project.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")
OUT = os.path.join(TESTS, "data", "ds_precision")


def worker(rank, world, port, job, out):
    from bench_ranks import start_rank, write_result

    deepspeed, _ = start_rank(rank, world, port, as_peer=True, cuda=False)
    sys.path.insert(0, TESTS)
    import precision_workload as w

    if job["part"] == "cases":
        write_result(out, rank, {name: w.train(deepspeed, name) for name in w.CASES})
    elif job["part"] == "zero_init":
        write_result(out, rank, w.zero_init_buffers(deepspeed))
    else:
        write_result(out, rank, {name: w.train_accumulation(deepspeed, name, rank) for name in w.ACCUM_CASES})


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
    result = {"deepspeed": deepspeed.__version__, "cases": spawn(worker, 1, {"part": "cases"})[0],
              "accumulation": spawn(worker, 2, {"part": "accumulation"}),
              "zero_init": spawn(worker, 1, {"part": "zero_init"})[0]}
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
