"""Turn a checkpoint directory into one fp32 state_dict file.

    dslaunch consolidate CKPT_DIR OUT [--tag TAG]
    python -m dslaunch.runtime.consolidate CKPT_DIR OUT [--tag TAG]

Works for every stage and topology: ZeRO shards (any world size, every pipeline stage) are
re-assembled by parameter name, a pipeline's layer files merged under its parameter names;
frozen parameters and buffers come from the module state saved beside them; tied
parameters appear under every name the model's state_dict uses. Checkpoints written by
DeepSpeed are read the same way. Every file is checked against the manifest's checksum
(dslaunch's checkpoints) and read with weights_only=True: consolidating a checkpoint
someone sent you runs none of its code. OUT ending in .safetensors is written
with the safetensors package when it is installed (tied tensors are stored as separate
copies there, as that format requires); anything else is written with torch.save.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Optional, Set

import click
import torch

from ...core.errors import CheckpointError
from .files import write_torch
from .layout import MANIFEST, model_states_name, read_latest, validate_tag, zero_model_states_name
from .reader import open_checkpoint
from ...zero.reshard import consolidated_state_dict
from . import moe, parallel, tensor_slices


def _aliases(module_state: Dict[str, torch.Tensor]) -> Dict[str, str]:
    """Keys whose tensor is the very same view as an earlier key's (tied weights)."""
    first: Dict[tuple, str] = {}
    out = {}
    for k, v in module_state.items():
        if not torch.is_tensor(v) or v.numel() == 0:
            continue
        ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if ident in first:
            out[k] = first[ident]
        else:
            first[ident] = k
    return out


def resolve_tag(ckpt_dir: str, tag: Optional[str]) -> str:
    """The tag directory to read: CKPT_DIR itself when it is one, else TAG or `latest`."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: not a directory")
    if tag is None:
        if any(os.path.exists(os.path.join(ckpt_dir, n))
               for n in (MANIFEST, model_states_name(), zero_model_states_name(0))):
            return ckpt_dir  # pointed at the tag directory itself
        tag = read_latest(ckpt_dir)
        if tag is None:
            raise CheckpointError(f"{os.path.join(ckpt_dir, 'latest')}: missing; pass --tag to choose a checkpoint")
    path = os.path.join(ckpt_dir, validate_tag(tag, "--tag"))
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint tag")
    return path


def consolidate_checkpoint(ckpt_dir: str, tag: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The full fp32 state_dict of the checkpoint `ckpt_dir/tag` (tag from `latest`), written
    by dslaunch or by DeepSpeed, any stage and world size."""
    ck = open_checkpoint(resolve_tag(ckpt_dir, tag))
    experts = moe.saved_experts(ck)
    if experts is not None:  # MoE: every expert file and every expert-parallel rank's state, by global id
        module_state = moe.global_module_state(ck, experts)
        shards = moe.global_shards(ck, experts, module_state) if ck.sharded else []
        return consolidated_state_dict(shards, module_state, _aliases(module_state))
    if tensor_slices.saved_size(ck) > 1 and not ck.layers:
        # tensor slices assembled into full tensors (fp32 weights from the optimizer state)
        module_state = tensor_slices.module_state(ck, None, 1, 0)
        shards = tensor_slices.optimizer_shard(ck, None, 1, 0, lambda s: parallel.slice_shards(ck, s))
        return consolidated_state_dict(shards, module_state, dict(ck.model.get("shared_params") or {}))
    # a pipeline's layer files merged under the pipeline's parameter names, or the saved module
    module_state = parallel.full_saved_module_state(ck)
    aliases = dict(ck.model.get("shared_params") or {}) or _aliases(module_state)
    if not ck.sharded and not ck.layers:
        return consolidated_state_dict([], module_state, aliases)
    # fp32 weights from every saved optimizer state (ZeRO shards, or each stage's own state)
    return consolidated_state_dict(parallel.all_shards(ck), module_state, aliases)


def frozen_parameter_names(ckpt_dir: str, tag: Optional[str] = None) -> Set[str]:
    """The parameters saved as frozen (requires_grad=False), from frozen_param_shapes: both
    tools record them under ZeRO 2 and 3 only, so at stages 0 and 1 this is empty (DeepSpeed's
    exclude_frozen_parameters has nothing to go on there either)."""
    ck = open_checkpoint(resolve_tag(ckpt_dir, tag))
    out: Set[str] = set()
    for s in range(ck.slices):
        out.update(ck.model_of(s).get("frozen_param_shapes") or {})
    return out


def check_output_outside(ckpt_dir: str, out: str) -> None:
    """OUT inside CKPT_DIR (a file of the tag being read, `latest`, a new name beside them)
    would replace or sit among the checkpoint's own files: refused before anything is read.
    Both paths are compared resolved, so a link or `..` cannot hide it."""
    root = os.path.realpath(ckpt_dir)
    target = os.path.realpath(out)
    if os.path.commonpath([root, target]) == root:
        raise CheckpointError(f"{out} is inside the checkpoint {ckpt_dir} being read, and writing it there could "
                              "destroy that checkpoint; write it outside")


def write_state_dict(state: Dict[str, torch.Tensor], out: str) -> None:
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create the folder of {out}: {exc.strerror}") from None
    if not out.endswith(".safetensors"):
        write_torch(out, state, checksum=False)  # no manifest lists it
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(f"{out}: the safetensors package is not installed; "
                              "pip install safetensors, or write a .pt file") from None
    tmp = out + ".part"
    try:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, tmp)
        os.replace(tmp, out)
    except OSError as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise CheckpointError(f"cannot write {out}: {exc.strerror}") from None


@click.command(help="Write the checkpoint in CKPT_DIR (a checkpoint folder, whose `latest` names the tag, or a "
                    "tag folder itself) as one fp32 state_dict file OUT. OUT's name picks the format: "
                    "*.safetensors is written with the safetensors package (an error if it is not installed), "
                    "any other name with torch.save.")
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--tag", default=None, help="checkpoint tag (default: the one named in CKPT_DIR/latest)")
def consolidate(ckpt_dir: str, out: str, tag: Optional[str]) -> None:
    try:
        check_output_outside(ckpt_dir, out)
        state = consolidate_checkpoint(ckpt_dir, tag)
        write_state_dict(state, out)
    except CheckpointError as exc:
        click.echo(f"dslaunch consolidate: {exc}", err=True)
        sys.exit(2)
    n = sum(v.numel() for k, v in state.items() if torch.is_tensor(v))
    click.echo(f"wrote {out}: {len(state)} tensors, {n:,} elements, fp32")


if __name__ == "__main__":
    consolidate.main(prog_name="python -m dslaunch.runtime.checkpoint.consolidate")
