"""Make the DeepSpeed Ulysses fixture tests/data/ds_sequence/expected.json with real DeepSpeed.

    .venv/bin/python scripts/make_ds_sp_fixtures.py --ds-python /work/ds-venv/bin/python

DeepSpeed (0.19.8, CPU, gloo) trains tests/sp_workload.py's tiny causal attention network,
its attention wrapped in `deepspeed.sequence.layer.DistributedAttention`, with
`sequence_parallel_size` 2 on 2 ranks (DeepSpeed's parallel_state_sp groups as the mpu), and the same network in one
process over the whole sequence. Cases (losses of 3 steps, averaged over the ranks):

  sp1         one process, AdamW
  sp2         sp=2, ZeRO 0, AdamW
  sp2_zero2   sp=2, ZeRO 2, AdamW
  sp1_sgd, sp2_sgd   the same with SGD, where the size of the gradient shows in the loss

tests/runtime/sequence/test_sequence_engine.py trains the same cases under dslaunch and compares. DeepSpeed
is run, never imported by the project.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests")
OUT = os.path.join(TESTS, "data", "ds_sequence")
CASES = {"sp1": (1, 0, "adamw"), "sp2": (2, 0, "adamw"), "sp2_zero2": (2, 2, "adamw"), "sp1_sgd": (1, 0, "sgd"),
         "sp2_sgd": (2, 0, "sgd")}
MICRO = 2


def worker(rank: int, world: int, port: int, job: dict, out: str) -> None:
    from bench_ranks import start_rank, write_result  # on sys.path when run as a script (tests import this file without it)

    deepspeed, _ = start_rank(rank, world, port, as_peer=True, cuda=False)
    from deepspeed.sequence.layer import DistributedAttention

    sys.path.insert(0, TESTS)
    import sp_workload

    sp = job["sp"]
    init = {}
    if sp > 1:
        # DeepSpeed's own Ulysses groups, given as the mpu (as its Hugging Face path does).
        # initialize(mesh_param=(dp, sp)) is not used: in 0.19.8 it leaves the gradient
        # reduction on the data-parallel group alone, so sequence ranks never exchange
        # gradients and their weights drift apart.
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(sp)
        init["mpu"] = parallel_state_sp
    losses, _ = sp_workload.train(deepspeed, DistributedAttention, sp, MICRO, stage=job["stage"],
                                  optimizer=job["optimizer"], init_kwargs=init)
    write_result(out, rank, losses)


def run_here(job: dict) -> list:
    from bench_ranks import spawn  # on sys.path when run as a script (tests import this file without it)
    return spawn(worker, job["sp"], job)[0]  # rank 0's losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-python", help="a Python with deepspeed 0.19.8 installed")
    p.add_argument("--job", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:  # inside the DeepSpeed Python: run one job, print its losses
        print("LOSSES " + json.dumps(run_here(json.loads(args.job))), flush=True)
        return
    if not args.ds_python:
        sys.exit("error: give --ds-python, a Python with deepspeed installed")
    os.makedirs(OUT, exist_ok=True)
    expected = {}
    for case, (sp, stage, optimizer) in CASES.items():
        job = {"sp": sp, "stage": stage, "optimizer": optimizer}
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=os.path.join(tempfile.gettempdir(), "ds-sp-fixture-ext"))
        proc = subprocess.run([args.ds_python, os.path.abspath(__file__), "--job", json.dumps(job)], env=env,
                              capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("LOSSES ")]
        if proc.returncode or not lines:
            sys.exit(f"error: DeepSpeed's run of {case} failed:\n{proc.stderr[-4000:]}")
        expected[case] = dict(job, losses=json.loads(lines[-1][len("LOSSES "):]))
        print(f"{case}: DeepSpeed {[round(x, 6) for x in expected[case]['losses']]}", flush=True)
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump(expected, fh, indent=1)


if __name__ == "__main__":
    main()
