"""Write tests/data/ds_zero_init_dtype.json: what DeepSpeed 0.19.8's zero.Init builds, dtypes and
values, for bf16 and fp16 configs, an fp32 config with dtype=bf16 or fp16, and an fp32 config
(scripts/zero_init_dtype_case.py, 2 ranks under torchrun).
tests/runtime/zero/test_zero_init_dtype_vs_deepspeed.py runs the same cases here and compares them.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    /work/ds-venv/bin/python scripts/make_ds_zero_init_dtype_fixtures.py
"""
import os

from ds_case_runs import record_deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_zero_init_dtype.json")
CASES = ["bf16:none", "fp16:none", "fp32:bf16", "fp32:fp16", "fp32:none"]  # CONFIG:DTYPE


def main() -> None:
    record_deepspeed(os.path.join(HERE, "zero_init_dtype_case.py"), CASES, OUT)


if __name__ == "__main__":
    main()
