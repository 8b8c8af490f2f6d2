"""`ds_to_universal`: write any checkpoint dslaunch reads (its own or DeepSpeed's, any ZeRO
stage and world size) in DeepSpeed's universal layout (universal.py), so DeepSpeed resumes
it at another topology with "checkpoint": {"load_universal": true}.

    dslaunch ds_to_universal --input_folder CKPT/global_step3 --output_folder CKPT/global_step3_universal
    python -m deepspeed.checkpoint.ds_to_universal ...    (the compatibility package)
    python -m dslaunch.runtime.checkpoint.ds_to_universal ...

The arguments are DeepSpeed's, declared once (_OPTIONS) for both the click command and
DeepSpeed's argparse `parse_arguments()`. --num_extract_workers and --num_merge_workers size
the thread pools that assemble and write the parameters; --inject_missing_state writes
universal_checkpoint_info into the output when the source lacks it, as DeepSpeed's does.
A tensor-parallel (AutoTP) checkpoint's slices are joined by its merge patterns
(universal_tp.py, tp_merge.py); --no_strict lets patterns that match no parameter pass, as
DeepSpeed's does (refused in one line for a checkpoint without tensor slices, which has
none to relax). --keep_temp_folder is refused in one line: the slice folder is always removed.
Bad input is one line and exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, List, Optional

import click

from ...core.errors import CheckpointError
# DeepSpeed's name for the check of a folder's per-file AutoEP metadata, which its tests import
from .ds_checkpoint import autoep_zero12_metadata as _aggregate_autoep_zero12_metadata  # noqa: F401
# DeepSpeed's names of the tensor-parallel merge steps its converter runs per parameter, for
# scripts and tests that call them on a slice folder (tp_merge.py); main runs them through
# universal_tp.py
from .tp_merge import group_per_tp_shapes as _group_per_tp_shapes  # noqa: F401
from .tp_merge import merge_tp_slices  # noqa: F401
from .tp_merge import merge_zero_shards as _merge_zero_shards  # noqa: F401
from .tp_merge import validate_autotp_conversion_support as _validate_autotp_conversion_support  # noqa: F401
from .universal import convert

_HELP = ("Write the checkpoint in --input_folder (a tag folder, or a save dir whose `latest` names one; "
         "dslaunch's or DeepSpeed's) in DeepSpeed's universal layout into --output_folder, and "
         "latest_universal beside it.")


@dataclass(frozen=True)
class _Option:
    name: str
    help: str
    type: Any = None  # None: a flag
    default: Any = None
    required: bool = False
    refused: str = ""  # non-empty: the one line a use of this flag gets


_OPTIONS = (
    _Option("input_folder", "the checkpoint to convert", str, required=True),
    _Option("output_folder", "the universal folder", str, required=True),
    _Option("num_extract_workers", "threads that assemble whole parameters from the saved partitions", int, 4),
    _Option("num_merge_workers", "threads that write the per-parameter files", int, 2),
    _Option("inject_missing_state", "write universal_checkpoint_info into the output if the source lacks it"),
    _Option("keep_temp_folder", "refused: the slice folder of a tensor-parallel conversion is always removed",
            refused="--keep_temp_folder: this converter always removes its slice folder (tensor-parallel "
                    "conversions) or writes none; drop the flag"),
    _Option("no_strict", "convert a tensor-parallel checkpoint even if some merge patterns match no parameter"),
)


def run(input_folder: str, output_folder: str, num_extract_workers: int = 4, num_merge_workers: int = 2,
        inject_missing_state: bool = False, no_strict: bool = False, **flags) -> int:
    for opt in _OPTIONS:
        if opt.refused and flags.get(opt.name):
            print(f"ds_to_universal: {opt.refused}", file=sys.stderr)
            return 2
    try:
        done = convert(input_folder, output_folder, extract_workers=num_extract_workers,
                       merge_workers=num_merge_workers, inject_missing_state=inject_missing_state,
                       strict=not no_strict)
    except CheckpointError as exc:
        print(f"ds_to_universal: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {done.output_folder}: {done.params} parameters (fp32, {', '.join(done.state_keys) or 'no state'}, "
          f"step) from a ZeRO stage {done.source_stage} checkpoint of {done.source_world_size} rank(s)")
    return 0


def _click_command():
    def command(**kwargs) -> None:
        sys.exit(run(**kwargs))

    for opt in reversed(_OPTIONS):
        flags = [f"--{opt.name}"] + ([f"--{opt.name.replace('_', '-')}"] if opt.required else [])
        if opt.type is None:
            command = click.option(*flags, opt.name, is_flag=True, help=opt.help)(command)
        else:
            # click 8.3 counts an explicit default=None as a value, which would satisfy `required`
            default = {} if opt.default is None else {"default": opt.default}
            command = click.option(*flags, opt.name, type=opt.type, required=opt.required, help=opt.help,
                                   **default)(command)
    return click.command(name="ds_to_universal", help=_HELP)(command)


ds_to_universal = _click_command()


def parse_arguments(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """DeepSpeed's parse_arguments, for scripts that call it and main(args)."""
    ap = argparse.ArgumentParser(description=_HELP)
    for opt in _OPTIONS:
        if opt.name == "no_strict":  # DeepSpeed's namespace carries it as `strict`
            ap.add_argument("--no_strict", dest="strict", action="store_false", help=opt.help)
        elif opt.type is None:
            ap.add_argument(f"--{opt.name}", action="store_true", help=opt.help)
        else:
            ap.add_argument(f"--{opt.name}", type=opt.type, default=opt.default, required=opt.required,
                            help=opt.help)
    return ap.parse_args(argv)


def main(args: Optional[argparse.Namespace] = None) -> None:
    """DeepSpeed's main(args); with no args, the command line."""
    if args is None:
        ds_to_universal.main(prog_name="ds_to_universal")
        return
    values = {o.name: getattr(args, o.name, o.default) for o in _OPTIONS if o.name != "no_strict"}
    values["no_strict"] = not getattr(args, "strict", True)
    code = run(**values)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    ds_to_universal.main(prog_name="python -m dslaunch.runtime.checkpoint.ds_to_universal")
