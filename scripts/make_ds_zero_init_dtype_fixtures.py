"""Write tests/data/ds_zero_init_dtype.json: what DeepSpeed 0.19.8's zero.Init builds, dtypes and
values, for bf16 and fp16 configs, an fp32 config with dtype=bf16 or fp16, and an fp32 config
(scripts/zero_init_dtype_case.py, 2 ranks under torchrun).
tests/runtime/zero/test_zero_init_dtype_vs_deepspeed.py runs the same cases here and compares them.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    /work/ds-venv/bin/python scripts/make_ds_zero_init_dtype_fixtures.py
"""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_zero_init_dtype.json")
CASES = ["bf16:none", "fp16:none", "fp32:bf16", "fp32:fp16", "fp32:none"]  # CONFIG:DTYPE


def main() -> None:
    try:
        import deepspeed
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", os.path.join(HERE, "zero_init_dtype_case.py"),
           "deepspeed"] + CASES  # --standalone: a free port
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
