"""Write tests/data/ds_sharded_moe.pt: what DeepSpeed's deepspeed.moe.sharded_moe gating
functions return for the calls in scripts/ds_sharded_moe_cases.py (tests/runtime/moe/test_sharded_moe_ds.py
holds dslaunch's against them).

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_sharded_moe_fixtures.py tests/data/ds_sharded_moe.pt
"""
import os
import sys

import deepspeed
import deepspeed.moe.sharded_moe as sharded_moe
import torch

sys.path.insert(0, os.path.dirname(__file__))
from ds_sharded_moe_cases import run  # noqa: E402  the cases, shared with the test


def main():
    torch.save({"deepspeed": deepspeed.__version__, "results": run(sharded_moe)}, sys.argv[1])


if __name__ == "__main__":
    main()
