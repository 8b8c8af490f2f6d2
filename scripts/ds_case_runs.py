"""What the case scripts run on both sides share (grad_accum_case.py, zero_init_dtype_case.py):
the `deepspeed` each side imports, the `RESULT {json}` line a case prints, and the recording of
DeepSpeed's answers: a case script under torchrun on 2 ranks, its RESULT lines written as a
fixture. Imports neither side itself, so it runs in DeepSpeed's own environment too."""
import json
import os
import subprocess
import sys
from typing import List

PREFIX = "RESULT "


def import_side(side: str):
    """The `deepspeed` a case script drives: real DeepSpeed, or dslaunch's runtime; its process
    group set up (gloo, from torchrun's environment)."""
    if side == "deepspeed":
        import deepspeed
    elif side == "dslaunch":
        import dslaunch.runtime as deepspeed
    else:
        sys.exit(f"error: the side is deepspeed or dslaunch, not {side!r}")
    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def print_result(record: dict) -> None:
    print(PREFIX + json.dumps(record), flush=True)


def results(stdout: str) -> List[dict]:
    return [json.loads(ln[len(PREFIX):]) for ln in stdout.splitlines() if ln.startswith(PREFIX)]


def record_deepspeed(script: str, cases: List[str], out: str, nprocs: int = 2) -> None:
    """Run `script deepspeed CASE...` under torchrun with this interpreter's DeepSpeed and write
    its results to `out` as {"deepspeed": version, "cases": [...]}; exits with DeepSpeed's error
    when a case does not answer."""
    try:
        import deepspeed
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    cmd = [torchrun, "--standalone", "--nproc_per_node", str(nprocs), script, "deepspeed"] + list(cases)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)  # --standalone: a free port
    got = results(proc.stdout)
    if proc.returncode != 0 or len(got) != len(cases):
        sys.exit(f"error: DeepSpeed's run failed (exit {proc.returncode}, {len(got)} of {len(cases)} cases):\n"
                 f"{proc.stderr[-3000:]}")
    with open(out, "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "cases": got}, fh)
        fh.write("\n")
    print(f"wrote {len(got)} cases to {out}")
