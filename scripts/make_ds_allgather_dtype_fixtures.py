"""Write tests/data/ds_allgather_dtype.json: DeepSpeed 0.19.8's
deepspeed.runtime.zero.partition_parameters.get_allgather_dtype(param, ds_tensor) for every
combination of the parameter's dtype, its shard's dtype and the autocast communication dtype
torch_autocast may have marked it with (none, bf16, fp16).
tests/runtime/zero/test_allgather_dtype_vs_deepspeed.py asks dslaunch the same and compares.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_allgather_dtype_fixtures.py
"""
import itertools
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_allgather_dtype.json")
DTYPES = ("float32", "bfloat16", "float16")


def main() -> None:
    try:
        import deepspeed
        import torch
        from deepspeed.runtime.torch_autocast import PARAM_COMM_DTYPE_ATTR_NAME
        from deepspeed.runtime.zero.partition_parameters import get_allgather_dtype
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    cases = []
    for param_dtype, shard_dtype, comm in itertools.product(DTYPES, DTYPES, (None, ) + DTYPES[1:]):
        param = torch.nn.Parameter(torch.zeros(4, dtype=getattr(torch, param_dtype)))
        if comm is not None:
            setattr(param, PARAM_COMM_DTYPE_ATTR_NAME, getattr(torch, comm))
        shard = torch.zeros(2, dtype=getattr(torch, shard_dtype))
        cases.append({"param": param_dtype, "shard": shard_dtype, "comm": comm,
                      "allgather": str(get_allgather_dtype(param, shard)).replace("torch.", "")})
    with open(OUT, "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "attribute": PARAM_COMM_DTYPE_ATTR_NAME, "cases": cases},
                  fh, indent=1)
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
