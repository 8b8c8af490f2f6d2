"""Write tests/data/ds_grad_accum.json: what DeepSpeed 0.19.8 accumulates over 4 bf16
micro-batches at ZeRO stages 1-3, with and without optimizer offload, with
data_types.grad_accum_dtype not written and written as fp32 (scripts/grad_accum_case.py, 2
ranks under torchrun). tests/runtime/zero/test_grad_accum_dtype_vs_deepspeed.py runs the same
cases here and compares them.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    /work/ds-venv/bin/python scripts/make_ds_grad_accum_fixtures.py
"""
import itertools
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_grad_accum.json")
CASES = list(itertools.product((1, 2, 3), ("none", "cpu"), ("default", "fp32")))  # (stage, offload, accum)


def main() -> None:
    try:
        import deepspeed
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", os.path.join(HERE, "grad_accum_case.py"),
           "deepspeed"] + [f"{s}:{o}:{a}" for s, o, a in CASES]  # --standalone: a free port
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    cases = [json.loads(ln[len("RESULT "):]) for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or len(cases) != len(CASES):
        sys.exit(f"error: DeepSpeed's run failed (exit {out.returncode}, {len(cases)} of {len(CASES)} cases):\n"
                 f"{out.stderr[-3000:]}")
    with open(OUT, "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases}, fh)
        fh.write("\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
