"""Which parameters Muon steps, and the param groups it is built from (DeepSpeed 0.19.8's rules).

`tag_parameters(model)` runs before the optimizer is built, on every parameter of the model
initialize() is given, and overwrites any tag already there, as DeepSpeed's
`set_optimizer_flags` does: `param.use_muon` is True for a parameter whose layer shape has
two or more dimensions and whose name contains neither "embed" nor "lm_head" (any case);
embeddings, the output head, norms and biases get False and go to the auxiliary Adam. The
shape is the layer's, not a ZeRO-3 shard's (`ds_shape`), so zero.Init does not turn Muon off.

`split_groups(model_parameters, settings)` splits each incoming group (or the plain list of
parameters) into its Muon half and its Adam half. Each half's settings resolve
most-specific-last: the config's shared value (lr, weight_decay, ...), then `muon_lr` /
`adam_lr`, then the incoming group's own keys that the half takes (Muon: lr, momentum,
weight_decay, ns_method; Adam: lr, betas, eps, weight_decay). A parameter without a tag
(passed in model_parameters but not part of the model) is an error, as in DeepSpeed.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence

import torch

from ..strict import ConfigError

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_NOT_MUON_NAMES = ("embed", "lm_head")
_CARRIED = ("moe", "name")  # group keys kept on both halves: expert groups keep their axis


def layer_shape(p: torch.Tensor) -> Sequence[int]:
    shape = getattr(p, "ds_shape", None)
    return tuple(p.shape) if shape is None else tuple(shape)


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    lowered = name.lower()
    return len(layer_shape(p)) >= 2 and not any(word in lowered for word in _NOT_MUON_NAMES)


def tag_parameters(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        p.use_muon = is_muon_param(name, p)


def half_defaults(settings: Dict[str, Any], keys: Iterable[str], override: str) -> Dict[str, Any]:
    out = {k: settings[k] for k in keys if k in settings}
    if override in settings:
        out["lr"] = settings[override]
    return out


def split_groups(model_parameters, settings: Dict[str, Any]) -> List[Dict[str, Any]]:
    groups, loose = [], []
    for item in model_parameters:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    untagged = sum(1 for g in groups for p in g["params"] if not hasattr(p, "use_muon"))
    if untagged:
        raise ConfigError(f"optimizer.type: Muon needs every parameter tagged with use_muon, and {untagged} are not: "
                          "model_parameters holds parameters that the model does not (initialize tags the model's); "
                          "set param.use_muon = True/False on them, or pass them as part of the model")
    halves = ((True, "muon", MUON_KEYS, half_defaults(settings, MUON_KEYS, "muon_lr")),
              (False, "adam", ADAM_KEYS, half_defaults(settings, ADAM_KEYS, "adam_lr")))
    out = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            values = dict(defaults)
            values.update({k: v for k, v in own.items() if k in keys})
            # one incoming group keeps DeepSpeed's plain names; several need distinct ones
            prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            carried = {k: own[k] for k in _CARRIED if k in own and k != "name"}
            out.append(dict(params=half, use_muon=use_muon, name=name, **carried, **values))
    return out
