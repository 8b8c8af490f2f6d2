#!/usr/bin/env python
"""Consolidate this checkpoint folder into fp32 weights (dslaunch's zero_to_fp32.py).

save_checkpoint copies this script next to the tags, as DeepSpeed does with its own, and
it takes DeepSpeed's arguments:

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization]
                           [--max_shard_size 5GB] [--exclude_frozen_parameters]

OUTPUT_DIR receives pytorch_model.bin (model.safetensors with --safe_serialization), or
numbered shards plus an index (pytorch_model.bin.index.json) when the weights exceed
--max_shard_size, as DeepSpeed's script writes them; an OUTPUT ending in .bin/.pt/
.safetensors is written as that one file. It reads dslaunch and DeepSpeed checkpoints
alike, any ZeRO stage, world size and pipeline topology, with weights_only=True. It needs
dslaunch installed (`dslaunch consolidate` is the same tool).

The same module is `deepspeed.utils.zero_to_fp32` under the compatibility package, with
DeepSpeed's functions: get_fp32_state_dict_from_zero_checkpoint,
convert_zero_checkpoint_to_fp32_state_dict, convert_zero_checkpoint_to_state_dict (any of
fp32/fp16/bf16) and load_state_dict_from_zero_checkpoint, and the file listings
get_optim_files / get_model_state_files (a tag folder's files in rank order).
"""
import argparse
import json
import os
import re
import sys

import torch

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _checkpoint_error(message: str):
    from dslaunch.runtime.train.checkpoint import CheckpointError

    return CheckpointError(message)


def parse_size(size) -> int:
    """"5GB" -> 5e9 bytes, "500MiB" -> 500 * 2**20 (Hugging Face's convention); ints are bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if m is None or m.group(2) not in _UNITS:
        raise _checkpoint_error(f"max_shard_size {size!r} is not a size such as 5GB or 500MB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _natural_key(name: str):
    """"zero_pp_rank_10_..." after "zero_pp_rank_9_...": digit runs compare as numbers."""
    return [int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", name)]


def get_checkpoint_files(checkpoint_dir, glob_pattern):
    """The files of one checkpoint tag folder matching glob_pattern, in rank order (digit runs
    compared as numbers, as DeepSpeed's script sorts them); none is a FileNotFoundError."""
    import glob

    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"no {glob_pattern} files in {checkpoint_dir}")
    return files


def get_optim_files(checkpoint_dir):
    """A tag folder's ZeRO optimizer-state files (*_optim_states.pt), in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir):
    """A tag folder's model-state files (*_model_states.pt), in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The full fp32 state_dict of the checkpoint `checkpoint_dir/tag` (tag from `latest`),
    as DeepSpeed's function of that name returns it. lazy_mode is accepted for DeepSpeed's
    signature; the tensors are always materialised (ZeRO shards are memory-mapped while read)."""
    from dslaunch.runtime.train.checkpoint.consolidate import consolidate_checkpoint, frozen_parameter_names

    state = consolidate_checkpoint(str(checkpoint_dir), tag)
    if exclude_frozen_parameters:
        frozen = frozen_parameter_names(str(checkpoint_dir), tag)
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def _shards(state, limit: int):
    """Hugging Face's greedy split: tensors in order, a new shard when the next would overflow."""
    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the checkpoint's fp32 weights into `output_dir` as DeepSpeed's function does:
    one pytorch_model.bin / model.safetensors, or shards and an index over max_shard_size
    (None: never shard). Returns the paths written."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype=torch.float32, max_shard_size="5GB",
                                          safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """DeepSpeed 0.19's generalisation of convert_zero_checkpoint_to_fp32_state_dict: the
    floating-point weights written in `dtype` (float32, float16 or bfloat16, as a torch dtype
    or its name); other buffers keep theirs. Shard sizes count the written dtype."""
    from dslaunch.runtime.train.checkpoint.consolidate import write_state_dict

    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise _checkpoint_error(f"convert_zero_checkpoint_to_state_dict: dtype {dtype!r}: expected one of "
                                    "float32, float16, bfloat16")
        dtype = _DTYPES[dtype.lower()]
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise _checkpoint_error(f"convert_zero_checkpoint_to_state_dict: dtype {dtype}: expected float32, float16 "
                                "or bfloat16")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    output_dir = str(output_dir)
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = _shards(state, parse_size(max_shard_size)) if max_shard_size is not None else [state]
    if len(shards) == 1:
        path = os.path.join(output_dir, weights)
        write_state_dict(state, path)
        return [path]
    stem, ext = os.path.splitext(weights)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}{ext}"
        path = os.path.join(output_dir, name)
        write_state_dict(shard, path)
        paths.append(path)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
             "weight_map": weight_map}
    index_path = os.path.join(output_dir, weights + ".index.json")
    with open(index_path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return paths + [index_path]


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """The checkpoint's fp32 weights loaded into `model` (moved to the CPU, strict=False), as
    DeepSpeed's function does; returns the model."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint_dir", help="the folder holding `latest` and the tags (or one tag folder)")
    ap.add_argument("output_dir", help="output folder, or one .bin/.pt/.safetensors file")
    ap.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    ap.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    ap.add_argument("--max_shard_size", default="5GB", help="largest output file before sharding (default 5GB)")
    ap.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    ap.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = ap.parse_args(argv)
    try:
        from dslaunch.runtime.train.checkpoint import CheckpointError
        from dslaunch.runtime.train.checkpoint.consolidate import write_state_dict
    except ImportError:
        print("zero_to_fp32.py: dslaunch is not installed here (pip install dslaunch)", file=sys.stderr)
        return 2
    try:
        out = args.output_dir
        if os.path.splitext(out)[1] in (".bin", ".pt", ".pth", ".safetensors") and not os.path.isdir(out):
            write_state_dict(get_fp32_state_dict_from_zero_checkpoint(
                args.checkpoint_dir, args.tag, args.exclude_frozen_parameters), out)
            written = [out]
        else:
            written = convert_zero_checkpoint_to_fp32_state_dict(
                args.checkpoint_dir, out, args.max_shard_size, args.safe_serialization, args.tag,
                args.exclude_frozen_parameters)
    except CheckpointError as exc:
        print(f"zero_to_fp32.py: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(written)} (fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
