"""Turn a checkpoint directory into one fp32 state_dict file.

    dslaunch consolidate CKPT_DIR OUT [--tag TAG]
    python -m dslaunch.runtime.consolidate CKPT_DIR OUT [--tag TAG]

Works for every stage: ZeRO shards (any world size) are re-assembled by parameter name;
frozen parameters and buffers come from the module state saved beside them; tied
parameters appear under every name the model's state_dict uses. OUT ending in
.safetensors is written with the safetensors package when it is installed (tied
tensors are stored as separate copies there, as that format requires); anything else
is written with torch.save.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, Optional

import click
import torch

from .zero.checkpoint import CheckpointError, consolidated_state_dict

MODEL_FILE = "mp_rank_00_model_states.pt"
MANIFEST = "manifest.json"


def _optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc})") from None


def _aliases(module_state: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """Keys whose tensor is the very same view as an earlier key's (tied weights)."""
    first: Dict[tuple, str] = {}
    out = {}
    for k, v in module_state.items():
        if not torch.is_tensor(v) or v.numel() == 0:
            continue
        ident = (v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if ident in first:
            out[k] = first[ident]
        else:
            first[ident] = k
    return out


def resolve_tag(ckpt_dir: str, tag: Optional[str]) -> str:
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: not a directory")
    if tag is None:
        latest = os.path.join(ckpt_dir, "latest")
        if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):
            return ckpt_dir  # pointed at the tag directory itself
        try:
            with open(latest) as fh:
                tag = fh.read().strip()
        except OSError:
            raise CheckpointError(f"{latest}: missing; pass --tag to choose a checkpoint") from None
    path = os.path.join(ckpt_dir, tag)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint tag")
    return path


def consolidate_checkpoint(ckpt_dir: str, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The full fp32 state_dict of the checkpoint `ckpt_dir/tag` (tag from `latest`)."""
    path = resolve_tag(ckpt_dir, tag)
    try:
        with open(os.path.join(path, MANIFEST)) as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: missing or unreadable (incomplete checkpoint?)") from None
    model = _load(os.path.join(path, MODEL_FILE))
    module_state = model["module"]
    if not manifest.get("sharded_optimizer_state"):
        return consolidated_state_dict([], module_state, _aliases(module_state))
    shards = [_load(os.path.join(path, _optim_file(r))) for r in range(int(manifest["world_size"]))]
    return consolidated_state_dict(shards, module_state, _aliases(module_state))


def write_state_dict(state: Dict[str, torch.Tensor], out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    if out.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(f"{out}: the safetensors package is not installed; "
                                  "pip install safetensors, or write a .pt file") from None
        save_file({k: v.contiguous().clone() for k, v in state.items()}, tmp)
    else:
        torch.save(state, tmp)
    os.replace(tmp, out)


@click.command(help="Write the checkpoint in CKPT_DIR as one fp32 state_dict file OUT "
                    "(.safetensors if the package is installed, otherwise torch format).")
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--tag", default=None, help="checkpoint tag (default: the one named in CKPT_DIR/latest)")
def consolidate(ckpt_dir: str, out: str, tag: Optional[str]) -> None:
    try:
        state = consolidate_checkpoint(ckpt_dir, tag)
        write_state_dict(state, out)
    except CheckpointError as exc:
        click.echo(f"dslaunch consolidate: {exc}", err=True)
        sys.exit(2)
    n = sum(v.numel() for k, v in state.items() if torch.is_tensor(v))
    click.echo(f"wrote {out}: {len(state)} tensors, {n:,} elements, fp32")


if __name__ == "__main__":
    consolidate.main(prog_name="python -m dslaunch.runtime.consolidate")
