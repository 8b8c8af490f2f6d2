"""Make the universal-checkpoint fixtures in tests/data/ds_universal/ with real DeepSpeed.

    .venv/bin/python scripts/make_ds_universal_fixtures.py --ds-python /work/ds-venv/bin/python

It starts from the interop fixtures (scripts/make_ds_fixtures.py: the same tiny MLP trained on
2 ranks by DeepSpeed 0.19.8 and by dslaunch, saved at step 3) and checks both directions at
another world size, 1 rank:

  ds/CASE/            DeepSpeed's converter (`python -m deepspeed.checkpoint.ds_to_universal
                      --inject_missing_state`, our fixture script saves no Megatron
                      universal_checkpoint_info) run on ds_interop/ds/CASE
  dslaunch/CASE/      dslaunch's converter (`python -m dslaunch.runtime.checkpoint.ds_to_universal`)
                      run on ds_interop/dslaunch/CASE
  expected.json       per case, the losses of the 3 steps after the save:
                        deepspeed                      DeepSpeed's uninterrupted 2-rank run
                        deepspeed_resumed_ds_universal    DeepSpeed on 1 rank, load_universal of ds/CASE
                        deepspeed_resumed_dslaunch_universal_stage<S>  DeepSpeed on 1 rank at ZeRO stage S
                                                       (the saved one, and another), load_universal of
                                                       dslaunch/CASE: DeepSpeed resumes what we write
                      OURS_ONLY cases (stage 0, which DeepSpeed's converter refuses: its error is
                      recorded as deepspeed_converter_error) have no ds/CASE

tests/runtime/train/checkpoint/test_checkpoint_universal.py uses them without DeepSpeed: dslaunch resumes ds/CASE at 1
and 2 ranks with DeepSpeed's losses, and our converter reproduces dslaunch/CASE (the folder
DeepSpeed resumed) and DeepSpeed's own ds/CASE, tensor for tensor. The script stops with a
non-zero status if DeepSpeed's resumed losses differ from its uninterrupted run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "tests", "data", "ds_interop")
OUT = os.path.join(ROOT, "tests", "data", "ds_universal")
_spec = importlib.util.spec_from_file_location("make_ds_fixtures", os.path.join(HERE, "make_ds_fixtures.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

# interop cases converted: torch's AdamW at stages 2 and 3 (ZeRO-3's converter writes another
# layout), DeepSpeed's default FusedAdam (an int step) under bf16 at stage 1
CASES = ("s2_fp32", "s3_fp32", "adam_s1_bf16")
# converted by us only: DeepSpeed's converter refuses stage 0 (its error is recorded); DeepSpeed's
# universal loading needs ZeRO, so it resumes ours at stages 1 and 2
OURS_ONLY = ("s0_bf16",)
OTHER_STAGE = {0: 2, 1: 3, 2: 3, 3: 1}  # DeepSpeed loads our universal folder at this stage too
SAME_STAGE = {0: 1}  # the stage DeepSpeed resumes at first, when not the saved one
TOL = {"fp32": 1e-5, "bf16": 2e-2}
UNIVERSAL = "{tag}_universal"


def _close(a, b, rel) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * max(abs(x), abs(y), 1e-12) for x, y in zip(a, b))


def _resume_universal(ds_python: str, case: fx.Case, save_dir: str, stage: int) -> list:
    """DeepSpeed on 1 rank, load_universal from save_dir (latest_universal), 3 steps."""
    job = dict(case._asdict(), stage=stage, engine="deepspeed", world=1, load=save_dir, universal=True)
    return fx.run(ds_python, job)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds-python", default="/work/ds-venv/bin/python", help="a python with deepspeed==0.19.8")
    args = ap.parse_args()
    expected, bad = {}, []
    for name in CASES + OURS_ONLY:
        case = fx.CASES[name]
        universal = UNIVERSAL.format(tag=case.tag)
        ds_dir, our_dir = os.path.join(OUT, "ds", name), os.path.join(OUT, "dslaunch", name)
        for d in (ds_dir, our_dir):
            shutil.rmtree(d, ignore_errors=True)
        os.makedirs(our_dir)
        ds_convert = subprocess.run(
            [args.ds_python, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
             os.path.join(SRC, "ds", name, case.tag), "--output_folder", os.path.join(ds_dir, universal),
             "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
            capture_output=True, text=True, cwd=ROOT)
        if (ds_convert.returncode == 0) != (name in CASES):
            raise SystemExit(f"{name}: DeepSpeed's converter exit status {ds_convert.returncode}: "
                             f"{ds_convert.stderr.strip().splitlines()[-1:]}")
        subprocess.run([sys.executable, "-m", "dslaunch.runtime.train.checkpoint.ds_to_universal", "--input_folder",
                        os.path.join(SRC, "dslaunch", name, case.tag), "--output_folder",
                        os.path.join(our_dir, universal)], check=True, cwd=ROOT)
        with open(os.path.join(SRC, "expected.json")) as fh:
            reference = json.load(fh)[name]["deepspeed"][case.save_at:]
        first, other = SAME_STAGE.get(case.stage, case.stage), OTHER_STAGE[case.stage]
        got = {"deepspeed": reference}
        if name in CASES:
            got["deepspeed_resumed_ds_universal"] = _resume_universal(args.ds_python, case, ds_dir, case.stage)
        got[f"deepspeed_resumed_dslaunch_universal_stage{first}"] = _resume_universal(args.ds_python, case, our_dir,
                                                                                       first)
        got[f"deepspeed_resumed_dslaunch_universal_stage{other}"] = _resume_universal(args.ds_python, case, our_dir,
                                                                                       other)
        expected[name] = dict(got)
        if name in OURS_ONLY:
            shutil.rmtree(ds_dir, ignore_errors=True)
            expected[name]["deepspeed_converter_error"] = ds_convert.stderr.strip().splitlines()[-1]
        for key, losses in got.items():
            print(f"{name}: {key:48s} {losses}", flush=True)
            if not _close(losses, reference, TOL[case.dtype]):
                bad.append(f"{name} {key}")
    with open(os.path.join(OUT, "expected.json"), "w") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)
    if bad:
        raise SystemExit(f"DeepSpeed's resumed losses differ from its uninterrupted run: {', '.join(bad)}")


if __name__ == "__main__":
    main()
