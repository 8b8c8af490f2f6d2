"""`ds_to_universal`: write any checkpoint dslaunch reads (its own or DeepSpeed's, any ZeRO
stage and world size) in DeepSpeed's universal layout (universal.py), so DeepSpeed resumes
it at another topology with "checkpoint": {"load_universal": true}.

    dslaunch ds_to_universal --input_folder CKPT/global_step3 --output_folder CKPT/global_step3_universal
    python -m deepspeed.checkpoint.ds_to_universal ...    (the compatibility package)
    python -m dslaunch.runtime.checkpoint.ds_to_universal ...

The arguments are DeepSpeed's. Its --num_extract_workers, --num_merge_workers,
--keep_temp_folder, --no_strict and --inject_missing_state are accepted so its command lines
run unchanged, and change nothing here: the conversion reads each file once in one process,
writes no temporary folder, and needs neither the merge patterns those checks are about nor
the universal_checkpoint_info DeepSpeed's converter asks the training script to save.
Bad input is one line and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import click

from .errors import CheckpointError
from .universal import convert

_HELP = ("Write the checkpoint in --input_folder (a tag folder, or a save dir whose `latest` names one; "
         "dslaunch's or DeepSpeed's) in DeepSpeed's universal layout into --output_folder, and "
         "latest_universal beside it.")
_NO_EFFECT = "accepted for DeepSpeed's command lines; no effect here (one process, no temporary folder)"


def run(input_folder: str, output_folder: str) -> int:
    try:
        done = convert(input_folder, output_folder)
    except CheckpointError as exc:
        print(f"ds_to_universal: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {done.output_folder}: {done.params} parameters (fp32, {', '.join(done.state_keys) or 'no state'}, "
          f"step) from a ZeRO stage {done.source_stage} checkpoint of {done.source_world_size} rank(s)")
    return 0


@click.command(help=_HELP)
@click.option("--input_folder", "--input-folder", "input_folder", required=True, help="the checkpoint to convert")
@click.option("--output_folder", "--output-folder", "output_folder", required=True, help="the universal folder")
@click.option("--num_extract_workers", type=int, default=4, help=_NO_EFFECT)
@click.option("--num_merge_workers", type=int, default=2, help=_NO_EFFECT)
@click.option("--keep_temp_folder", is_flag=True, help=_NO_EFFECT)
@click.option("--no_strict", is_flag=True, help=_NO_EFFECT)
@click.option("--inject_missing_state", is_flag=True, help=_NO_EFFECT)
def ds_to_universal(input_folder: str, output_folder: str, **_unused) -> None:
    sys.exit(run(input_folder, output_folder))


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """DeepSpeed's parse_arguments, for scripts that call it and main(args)."""
    ap = argparse.ArgumentParser(description=_HELP)
    ap.add_argument("--input_folder", required=True)
    ap.add_argument("--output_folder", required=True)
    ap.add_argument("--num_extract_workers", type=int, default=4, help=_NO_EFFECT)
    ap.add_argument("--num_merge_workers", type=int, default=2, help=_NO_EFFECT)
    ap.add_argument("--keep_temp_folder", action="store_true", help=_NO_EFFECT)
    ap.add_argument("--no_strict", dest="strict", action="store_false", help=_NO_EFFECT)
    ap.add_argument("--inject_missing_state", action="store_true", help=_NO_EFFECT)
    return ap.parse_args(argv)


def main(args: Optional[argparse.Namespace] = None) -> None:
    """DeepSpeed's main(args); with no args, the command line."""
    if args is None:
        ds_to_universal.main(prog_name="ds_to_universal")
        return
    code = run(args.input_folder, args.output_folder)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    ds_to_universal.main(prog_name="python -m dslaunch.runtime.checkpoint.ds_to_universal")
