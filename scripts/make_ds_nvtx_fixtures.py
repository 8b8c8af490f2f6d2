"""Write tests/data/ds_nvtx.json: the profiler-range calls DeepSpeed 0.19.8's
deepspeed.utils.nvtx.instrument_w_nvtx makes in each case of scripts/nvtx_cases.py (an
accelerator with NVTX domains or without, instrumentation switched off, under torch.compile).
tests/runtime/core/test_nvtx_ranges.py replays the cases on dslaunch's module.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_nvtx_fixtures.py tests/data/ds_nvtx.json
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import deepspeed.utils.nvtx as nvtx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from nvtx_cases import run_all  # noqa: E402  the cases, shared with the test


def main():
    out = {"deepspeed": deepspeed.__version__, "cases": run_all(nvtx)}
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
