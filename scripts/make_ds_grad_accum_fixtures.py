"""Write tests/data/ds_grad_accum.json: what DeepSpeed 0.19.8 accumulates over 4 bf16
micro-batches at ZeRO stages 1-3, with and without optimizer offload, with
data_types.grad_accum_dtype not written and written as fp32 (scripts/grad_accum_case.py, 2
ranks under torchrun). tests/runtime/zero/test_grad_accum_dtype_vs_deepspeed.py runs the same
cases here and compares them.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    /work/ds-venv/bin/python scripts/make_ds_grad_accum_fixtures.py
"""
import itertools
import os

from ds_case_runs import record_deepspeed

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_grad_accum.json")
CASES = list(itertools.product((1, 2, 3), ("none", "cpu"), ("default", "fp32")))  # (stage, offload, accum)


def main() -> None:
    record_deepspeed(os.path.join(HERE, "grad_accum_case.py"), [f"{s}:{o}:{a}" for s, o, a in CASES], OUT)


if __name__ == "__main__":
    main()
