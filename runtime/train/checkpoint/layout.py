"""Where everything of a checkpoint lives: the one place that knows file names.

    SAVE_DIR/
      latest                                    the tag to resume from (text, no newline)
      zero_to_fp32.py                           consolidation script, as DeepSpeed ships it
      TAG/
        manifest.json                           dslaunch: every file's size and checksum, written last
        mp_rank_XX_model_states.pt              module, scheduler, counters, client_state
        zero_pp_rank_D_mp_rank_XX_model_states.pt   ZeRO-3: one per data-parallel rank
        [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt   sharded optimizer state, one per dp rank
        layer_LL[-model_XX]-model_states.pt     pipelines: one per layer (and model-parallel rank)
        rng_state_rank_R.pt                     dslaunch: every rank's RNG states

These are DeepSpeed's names, so either tool finds the other's files. Two of DeepSpeed's
conventions are easy to get wrong and are kept here on purpose:
- "zero_pp_rank_D" carries the *data-parallel* rank D (DeepSpeed's misnomer);
- "mp_rank_XX" carries the rank within the (pipe, model) slice of the topology, which is
  what DeepSpeed's PipelineParallelGrid.get_model_parallel_rank() returns:
  pp_rank * mp_world_size + mp_rank (see `slice_rank`). Without a pipeline it is the
  model-parallel rank.
Layer files carry the global layer index and, only when model parallelism is used, the
model-parallel rank ("-model_01"), as DeepSpeed's PipelineModule.ckpt_layer_path does.

Tags name directories directly under SAVE_DIR: `validate_tag` refuses anything that is
not a plain directory name, and `read_latest` refuses a `latest` that leads outside.
"""
from __future__ import annotations

import os
from typing import Optional

from ...core.errors import CheckpointError

MANIFEST = "manifest.json"
LATEST = "latest"
RECOVERY_SCRIPT = "zero_to_fp32.py"

# Directory prefixes reserved for a save in progress (see saving.py); never valid user tags.
STAGING, PREVIOUS, TRASH = ".tmp.", ".old.", ".trash."
_MAX_TAG = 200  # leaves room for the prefixes within the usual 255-byte name limit

MODEL, ZERO_MODEL, OPTIM, LAYER, RNG = "model", "zero_model", "optim", "layer", "rng"


def slice_rank(pp_rank: int = 0, mp_rank: int = 0, mp_world_size: int = 1) -> int:
    """The number DeepSpeed writes as mp_rank_XX: this rank's index in its (pipe, model) slice."""
    return pp_rank * mp_world_size + mp_rank


def model_states_name(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_model_states_name(dp_rank: int, mp_rank: int = 0) -> str:
    """ZeRO-3 writes one model-states file per data-parallel rank."""
    return f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_states_name(dp_rank: int, mp_rank: int = 0, bf16: bool = False) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def layer_states_name(layer: int, mp_rank: Optional[int] = None) -> str:
    """mp_rank None (no model parallelism) leaves the rank out, as DeepSpeed does."""
    return f"layer_{layer:02d}{'' if mp_rank is None else f'-model_{mp_rank:02d}'}-model_states.pt"


def rng_states_name(rank: int) -> str:
    return f"rng_state_rank_{rank}.pt"


def file_name(kind: str, *, dp_rank: int = 0, pp_rank: int = 0, mp_rank: int = 0, mp_world_size: int = 1,
              layer: Optional[int] = None, bf16: bool = False, global_rank: int = 0) -> str:
    """One entry point for every file name: kind is MODEL, ZERO_MODEL, OPTIM, LAYER or RNG;
    ranks are topology coordinates (dp, pp, mp); `bf16` selects DeepSpeed's bf16_ optimizer
    prefix. Layer files name the model-parallel rank only when mp_world_size > 1."""
    mp = slice_rank(pp_rank, mp_rank, mp_world_size)
    if kind == MODEL:
        return model_states_name(mp)
    if kind == ZERO_MODEL:
        return zero_model_states_name(dp_rank, mp)
    if kind == OPTIM:
        return optim_states_name(dp_rank, mp, bf16)
    if kind == LAYER:
        if layer is None:
            raise ValueError("file_name(LAYER) needs layer=")
        return layer_states_name(layer, mp_rank if mp_world_size > 1 else None)
    if kind == RNG:
        return rng_states_name(global_rank)
    raise ValueError(f"unknown checkpoint file kind {kind!r}")


def tag_problem(tag: str) -> Optional[str]:
    """Why `tag` cannot name a checkpoint directory, or None."""
    if tag == "":
        return "is empty"
    if tag != tag.strip():
        return "has leading or trailing whitespace"
    if tag in (LATEST, "latest_universal"):
        return f"is reserved (the {tag} file lives beside the tags)"
    if tag in (".", ".."):
        return "is not a directory name"
    if "/" in tag or "\\" in tag or os.sep in tag or (os.altsep and os.altsep in tag):
        return "contains a path separator"
    if ".." in tag:
        return "contains '..'"
    if tag.startswith("."):
        return "starts with '.' (reserved for saves in progress)"
    if any(ord(c) < 32 or ord(c) == 127 for c in tag):
        return "contains a control character"
    if len(tag.encode()) > _MAX_TAG:
        return f"is longer than {_MAX_TAG} bytes"
    return None


def validate_tag(tag, what: str = "tag") -> str:
    if tag is None:
        raise CheckpointError(f"checkpoint {what}: none given")
    tag = str(tag)
    problem = tag_problem(tag)
    if problem:
        raise CheckpointError(f"checkpoint {what} {tag!r} {problem}")
    return tag


def tag_path(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, tag)


def read_latest(save_dir: str, name: str = LATEST) -> Optional[str]:
    """The tag `save_dir/latest` (or `name`: `latest_universal`) names, or None when there is
    no such file. The tag must be a plain name (or the pointer a save in progress leaves,
    PREVIOUS + tag) whose directory resolves inside save_dir."""
    from dslaunch.launcher.bounded_read import read_bounded  # a FIFO or device named latest: refused, not read

    latest = os.path.join(save_dir, name)
    try:
        raw = read_bounded(latest, 4096, "the file naming the latest tag", CheckpointError)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{latest}: cannot be read: {exc.strerror or exc}") from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{latest}: is not a text file naming a tag") from None
    plain = tag[len(PREVIOUS):] if tag.startswith(PREVIOUS) else tag
    problem = tag_problem(plain)
    if problem:
        raise CheckpointError(f"{latest} names {tag!r}, which {problem}; refusing to follow it")
    root = os.path.realpath(save_dir)
    target = os.path.realpath(os.path.join(save_dir, tag))
    if os.path.dirname(target) != root:
        raise CheckpointError(f"{latest} names {tag!r}, which resolves to {target}, outside {root}; "
                              "refusing to follow it")
    return tag
