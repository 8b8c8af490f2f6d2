"""`checkpoint=`: load full-model weights straight into the sharded layers.

Accepted forms:
- a DeepSpeed inference checkpoint json (path or dict): {"type": "ds_model" | "bloom",
  "checkpoints": [files...], "version": 1.0, "base_dir": optional}; each file holds full
  tensors for some of the model's keys (the Hugging Face shard files, for instance);
- a state_dict file: torch.save'd (.pt/.bin/.pth; a DeepSpeed/dslaunch `module`/`model`
  wrapper is unwrapped) or .safetensors;
- a directory: a DeepSpeed/dslaunch training checkpoint (`latest` -> <tag>/mp_rank_00_model_states.pt)
  or a Hugging Face save_pretrained folder (model.safetensors, pytorch_model.bin, or a
  sharded *.index.json).

What the script passes (a path, a dict, base_dir) is trusted; what files say is not: a
descriptor file's "checkpoints" and "base_dir", a folder's `latest` and a safetensors
index's file names must stay under the folder they belong to (init_inference's base_dir
when given, else the descriptor's own folder), by `..` or an absolute path alike, as the
training loader refuses a `latest` that leads out of its folder. Descriptors and indexes
are read bounded (dslaunch.launcher.bounded_read) and must be JSON objects.

Files are opened memory-mapped (torch.load(mmap=True), safetensors' lazy slices), and each
parallel layer copies only its slice, so a rank reads roughly its share of the bytes and
never holds a full copy of the model; at most one full tensor of a replicated layer is in
flight. Keys the model does not have are counted and reported; a tensor that must come from
the checkpoint (a meta-device model's) and does not is an error naming it.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Set, Tuple

import torch
from torch import nn

from ..core.errors import CheckpointError
from ..train.checkpoint.layout import read_latest  # the training loader's reading of `latest`
from .layers import ParallelEmbedding, ParallelLinear, local_part

_WRAPPER_KEYS = ("module", "model", "state_dict")


@dataclass
class LoadReport:
    files: List[str] = field(default_factory=list)
    loaded: Set[int] = field(default_factory=set)  # id() of every model tensor that received data
    unused: List[str] = field(default_factory=list)  # checkpoint keys the model has no tensor for


DESCRIPTOR_LIMIT = 64 << 20  # a descriptor or index lists file names: a few MiB even for thousands of shards


def _read_json(path: str, what: str) -> Dict[str, Any]:
    """A JSON object from `path`, read bounded (a FIFO, a device or a huge file is refused)."""
    from dslaunch.launcher.bounded_read import read_bounded

    try:
        data = json.loads(read_bounded(path, DESCRIPTOR_LIMIT, what, CheckpointError))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}") from None
    except (UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{path}: {what} is not valid JSON text") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, not a JSON {type(data).__name__}")
    return data


def _under(root: str, name: Any, where: str, what: str, base: str = "") -> str:
    """`name` (from a file) joined onto `base` (default `root`), refused unless it stays
    under `root`. The check is on the names, not on resolved links: a Hugging Face cache
    folder's files are links into its blob store, and those are the folder owner's doing;
    what a descriptor may not do is name, by `..` or an absolute path, a file elsewhere."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: {what} {name!r} is not a file name")
    path = os.path.normpath(os.path.join(base or root, name))
    top = os.path.normpath(os.path.abspath(root))
    if os.path.commonpath([os.path.abspath(path), top]) != top:
        raise CheckpointError(f"{where}: {what} {name!r} leads outside {top}; a checkpoint descriptor may name only "
                              "files under its base_dir (pass init_inference(base_dir=...) to choose that folder)")
    return path


def _json_files(data: Dict[str, Any], where: str, root: str, confine: bool = True) -> List[str]:
    kind = str(data.get("type", "")).lower()
    ckpts = data.get("checkpoints")
    if kind not in ("ds_model", "bloom"):
        raise CheckpointError(f"{where}: checkpoint type {data.get('type')!r} is not supported "
                              "(\"ds_model\" or \"bloom\" with full-tensor files)")
    if isinstance(ckpts, dict):
        raise CheckpointError(f"{where}: pre-sharded \"tp\"/\"non_tp\" checkpoints (DeepSpeed kernel-injection "
                              "format) are not supported; list the full-model files instead")
    if not isinstance(ckpts, list) or not ckpts or not all(isinstance(c, str) for c in ckpts):
        raise CheckpointError(f"{where}: \"checkpoints\" must be a non-empty list of file names")
    if not confine:  # the script's own dict: its names are taken as they are, as DeepSpeed does
        base = data.get("base_dir") or root
        return [os.path.join(base, c) if base and not os.path.isabs(c) else c for c in ckpts]
    base = _under(root, data["base_dir"], where, "base_dir") if data.get("base_dir") else root
    return [_under(root, c, where, "\"checkpoints\" entry", base) for c in ckpts]


def _dir_files(path: str) -> List[str]:
    tag = read_latest(path)
    if tag is not None:
        return [os.path.join(path, tag, "mp_rank_00_model_states.pt")]
    for index in sorted(glob.glob(os.path.join(path, "*.index.json"))):
        weight_map = _read_json(index, "safetensors index").get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: \"weight_map\" must be a JSON object of tensor names to file names")
        return [_under(path, f, index, "\"weight_map\" file") for f in sorted(set(map(str, weight_map.values())))]
    for name in ("model.safetensors", "pytorch_model.bin", "mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    raise CheckpointError(f"{path}: no checkpoint found (expected latest, *.index.json, model.safetensors or "
                          "pytorch_model.bin)")


def checkpoint_files(checkpoint, base_dir: str = "") -> List[str]:
    """The files to load. What the script passed (the path, a dict, base_dir) is trusted;
    what files say (a descriptor file's entries and base_dir, `latest`, an index's file
    names) must stay under the folder they belong to: init_inference's base_dir when
    given, else the descriptor's own folder."""
    if isinstance(checkpoint, dict):
        files = _json_files(checkpoint, "checkpoint", base_dir, confine=False)
    elif os.path.isdir(checkpoint):
        files = _dir_files(checkpoint)
    elif checkpoint.endswith(".json"):
        data = _read_json(checkpoint, "checkpoint descriptor")
        files = _json_files(data, checkpoint, base_dir or os.path.dirname(os.path.abspath(checkpoint)))
    else:
        files = [checkpoint]
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: checkpoint file not found")
    return files


class _StateFile:
    """One checkpoint file, open for lazy reads: keys() and get(key)."""

    def __init__(self, path: str):
        self.path = path
        self._safe = None
        self._sd: Dict[str, torch.Tensor] = {}
        if path.endswith(".safetensors"):
            try:
                from safetensors import safe_open
            except ImportError:
                raise CheckpointError(f"{path}: reading .safetensors needs the safetensors package") from None
            try:
                self._safe = safe_open(path, framework="pt")
            except Exception as exc:  # a damaged or foreign file: one line naming it
                raise CheckpointError(f"{path}: cannot load checkpoint: {str(exc).splitlines()[0]}") from None
            return
        try:
            sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # a damaged or foreign file: one line naming it
            raise CheckpointError(f"{path}: cannot load checkpoint: {str(exc).splitlines()[0]}") from None
        for wrapper in _WRAPPER_KEYS:
            if isinstance(sd, dict) and isinstance(sd.get(wrapper), dict):
                sd = sd[wrapper]
                break
        if not isinstance(sd, dict):
            raise CheckpointError(f"{path}: not a state_dict (got {type(sd).__name__})")
        self._sd = {k: v for k, v in sd.items() if torch.is_tensor(v)}

    def keys(self) -> List[str]:
        return list(self._safe.keys()) if self._safe is not None else list(self._sd)

    def get(self, key: str) -> torch.Tensor:
        return self._safe.get_tensor(key) if self._safe is not None else self._sd[key]


def _expected_full_shape(module: nn.Module, pname: str, local: torch.Tensor) -> Tuple[int, ...]:
    if isinstance(module, ParallelLinear):
        if pname == "bias":
            return (module.full_out,)
        return (module.full_in, module.full_out) if module.conv1d else (module.full_out, module.full_in)
    if isinstance(module, ParallelEmbedding):
        return (module.num_embeddings, module.embedding_dim)
    shard = getattr(module, "tp_shard", None)
    if shard is not None:
        return (shard[0].in_features, shard[0].out_features)
    return tuple(local.shape)


def _copy_into(module: nn.Module, pname: str, full: torch.Tensor, key: str, path: str) -> torch.Tensor:
    """Copy this rank's part of `full` into the module's tensor `pname`; returns that tensor."""
    target = module._parameters.get(pname)
    target = module._buffers.get(pname) if target is None else target
    local = target if target is not None else getattr(module, pname)
    expected = _expected_full_shape(module, pname, local)
    if tuple(full.shape) != expected:
        raise CheckpointError(f"{path}: {key} has shape {tuple(full.shape)}, the model expects {expected}")
    if isinstance(module, (ParallelLinear, ParallelEmbedding)):
        module.load_full_(pname, full)
    elif getattr(module, "tp_shard", None) is not None:
        shard, tp, rank = module.tp_shard
        local.data.copy_(local_part(full, shard, tp, rank, pname))
    else:
        local.data.copy_(full)
    return local


def _prefix_fix(keys: List[str], names: Set[str], prefix: str) -> Callable[[str], str]:
    """Map checkpoint keys onto model names when one side has the base-model prefix the other lacks."""
    if not prefix or any(k in names for k in keys):
        return lambda k: k
    if any(f"{prefix}.{k}" in names for k in keys):
        return lambda k: f"{prefix}.{k}"
    if any(k.startswith(prefix + ".") and k[len(prefix) + 1:] in names for k in keys):
        return lambda k: k[len(prefix) + 1:] if k.startswith(prefix + ".") else k
    return lambda k: k


def load_checkpoint(model: nn.Module, checkpoint, base_dir: str = "") -> LoadReport:
    report = LoadReport(files=checkpoint_files(checkpoint, base_dir))
    modules = dict(model.named_modules(remove_duplicate=False))
    names = {f"{m}.{p}" if m else p for m, mod in modules.items()
             for p in list(mod._parameters) + list(mod._buffers) + (["weight"] if isinstance(
                 mod, (ParallelLinear, ParallelEmbedding)) else [])}
    prefix = getattr(model, "base_model_prefix", "") or ""
    with torch.no_grad():
        for path in report.files:
            state = _StateFile(path)
            keys = state.keys()
            fix = _prefix_fix(keys, names, prefix)
            for key in keys:
                name = fix(key)
                mod_name, _, pname = name.rpartition(".")
                module = modules.get(mod_name)
                if module is None or name not in names:
                    report.unused.append(key)
                    continue
                report.loaded.add(id(_copy_into(module, pname, state.get(key), key, path)))
    return report
