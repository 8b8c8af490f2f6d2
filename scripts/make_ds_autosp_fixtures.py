"""Write tests/data/ds_autosp.pt: what DeepSpeed 0.19.8's AutoSP fusion splices and detector
answer for the calls in scripts/autosp_cases.py (tests/runtime/sequence/test_sequence_autosp.py
holds dslaunch's against them). One process, CPU, no process group.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_autosp_fixtures.py tests/data/ds_autosp.pt
"""
import os
import sys

import deepspeed
import deepspeed.sequence.autosp_detector as detector
import deepspeed.sequence.autosp_fusion as fusion
import torch

sys.path.insert(0, os.path.dirname(__file__))
from autosp_cases import run_detector, run_splices  # noqa: E402  the cases, shared with the test


def main():
    torch.save({"deepspeed": deepspeed.__version__, "splices": run_splices(fusion),
                "detector": run_detector(detector)}, sys.argv[1])


if __name__ == "__main__":
    main()
