"""Optimizer state between optimizers: whatever DeepSpeed (or dslaunch) stepped with when it
saved, as the optimizer this engine steps with keeps it, and back.

DeepSpeed picks its optimizer from the config (engine._configure_basic_optimizer):
FusedAdam for Adam/AdamW (on GPU and on its CPU accelerator), DeepSpeedCPUAdam,
DeepSpeedCPULion or DeepSpeedCPUAdagrad when ZeRO offloads the step, torch's AdamW with
"torch_adam": true, torch's Adagrad, FusedLion, FusedLamb. dslaunch picks its own for the
same config (optim.py). Their per-parameter states hold the same quantities but not in the
same form:

- the step count. torch's optimizers and dslaunch's keep a float32 tensor per parameter.
  DeepSpeed's own keep a Python int, and FusedAdam/FusedLion step a whole param group with
  the count of its last parameter: the others keep their first count (a stage-0 checkpoint
  holds e.g. steps 0, 0, 0, 6) and the group carries a "step" of 0 that means nothing.
- names: DeepSpeedCPUAdagrad calls Adagrad's sum of squares "exp_avg_sq" (torch: "sum");
  DeepSpeedCPULion keeps an "exp_avg_sq" of zeros that Lion never reads.
- the group's hyperparameter keys: each class reads its own (FusedAdam's bias_correction,
  torch's Adagrad's lr_decay, ...), and torch's load_state_dict takes the saved groups whole.

`to_ours` (used by load_checkpoint on whatever it read: a stage-0 state, one ZeRO shard or
every saved rank's) turns a saved state into this engine's optimizer's form, and refuses
in one line a state that is not that optimizer's (Adam's moments into Lion, a missing or an
unknown key). `for_deepspeed` (used by save_checkpoint) writes the form of the optimizer
DeepSpeed builds for this config, so DeepSpeed's load_checkpoint resumes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional

import torch

from ...core.errors import CheckpointError


@dataclass(frozen=True)
class StateForm:
    """How one optimizer keeps its per-parameter state and its param groups."""

    family: str                        # "Adam", "Lion", "Adagrad", "Lamb"
    keys: FrozenSet[str]               # per-parameter tensors besides "step"
    int_step: bool = False             # a Python int (DeepSpeed's optimizers) or a float32 tensor (torch's)
    names: Mapping[str, str] = field(default_factory=dict)  # our key -> this optimizer's name for it
    group_defaults: Mapping[str, Any] = field(default_factory=dict)  # group keys this optimizer reads
    step_optional: bool = False        # Muon's momentum counts no steps (DeepSpeed keeps none)


# The family's keys; amsgrad adds max_exp_avg_sq to Adam's.
_KEYS = {"Adam": frozenset({"exp_avg", "exp_avg_sq"}), "Lion": frozenset({"exp_avg"}),
         "Adagrad": frozenset({"sum"}), "Lamb": frozenset({"exp_avg", "exp_avg_sq"}),
         "Muon": frozenset({"momentum_buffer"})}
MUON_FORM = StateForm("Muon", _KEYS["Muon"], step_optional=True)
# Keys a saved state may carry that the family never reads, dropped when they hold zeros only.
_INERT = {"Lion": ("exp_avg_sq",)}  # DeepSpeedCPULion allocates it and never updates it
# Other optimizers' names for the family's keys.
_ALIASES = {"Adagrad": {"exp_avg_sq": "sum"}}  # DeepSpeedCPUAdagrad


def group_forms(optimizer: Optional[torch.optim.Optimizer]) -> Optional[List[Optional[StateForm]]]:
    """Each param group's form: Muon's groups are its own or its auxiliary Adam's (an inline
    Adam keeps Adam's keys); every other optimizer's groups share form_of's answer."""
    from ...core.muon.optimizer import MuonWithAuxAdam

    if isinstance(optimizer, MuonWithAuxAdam):
        adam = form_of(optimizer.adam) if optimizer.adam is not None else StateForm("Adam", _KEYS["Adam"])
        return [MUON_FORM if g["use_muon"] else adam for g in optimizer.param_groups]
    form = form_of(optimizer)
    return None if form is None else [form] * len(optimizer.param_groups)


def form_of(optimizer: Optional[torch.optim.Optimizer]) -> Optional[StateForm]:
    """The form of an optimizer dslaunch steps with; None for one whose state is passed
    through as torch's load_state_dict takes it (SGD, RMSprop, a client's own, ...)."""
    from dslaunch.kernels import CPUAdagrad, CPUAdam, CPULion, FusedAdam, Lamb, Lion

    if optimizer is None:
        return None
    families = ((CPUAdam, "Adam"), (FusedAdam, "Adam"), (torch.optim.Adam, "Adam"), (torch.optim.AdamW, "Adam"),
                (Lion, "Lion"), (CPULion, "Lion"), (CPUAdagrad, "Adagrad"), (torch.optim.Adagrad, "Adagrad"),
                (Lamb, "Lamb"))
    for cls, family in families:
        if type(optimizer) is cls or isinstance(optimizer, cls) and type(optimizer).__module__.startswith("dslaunch"):
            keys = _KEYS[family]
            if family == "Adam" and any(g.get("amsgrad") for g in optimizer.param_groups):
                keys = keys | {"max_exp_avg_sq"}
            return StateForm(family, keys)
    return None


# DeepSpeed 0.19.8's optimizers: their group keys (constructor defaults) and state forms.
_ADAM_GROUP = {"bias_correction": True}
_DS_FORMS = {
    "FusedAdam": StateForm("Adam", _KEYS["Adam"], True, group_defaults=_ADAM_GROUP),
    "DeepSpeedCPUAdam": StateForm("Adam", _KEYS["Adam"], True, group_defaults={**_ADAM_GROUP, "amsgrad": False}),
    "DeepSpeedCPULion": StateForm("Lion", _KEYS["Lion"], True),
    "FusedLion": StateForm("Lion", _KEYS["Lion"], True),
    "DeepSpeedCPUAdagrad": StateForm("Adagrad", _KEYS["Adagrad"], True, names={"sum": "exp_avg_sq"},
                                     group_defaults={"amsgrad": False}),
    "FusedLamb": StateForm("Lamb", _KEYS["Lamb"], True,
                           group_defaults={**_ADAM_GROUP, "max_grad_norm": 0.0, "max_coeff": 10.0, "min_coeff": 0.01}),
}


def deepspeed_optimizer(opt_type: Optional[str], params: Mapping[str, Any], offload: bool) -> Optional[str]:
    """The class DeepSpeed 0.19.8 builds for this config's optimizer section, when it is one
    of its own (None: torch's, or no optimizer section)."""
    name = (opt_type or "").lower()
    if name in ("adam", "adamw"):
        return None if params.get("torch_adam") else "DeepSpeedCPUAdam" if offload else "FusedAdam"
    return {"lion": "DeepSpeedCPULion" if offload else "FusedLion", "adagrad": "DeepSpeedCPUAdagrad" if offload
            else None, "lamb": "FusedLamb", "cpuadam": "DeepSpeedCPUAdam", "deepspeedcpuadam": "DeepSpeedCPUAdam",
            "fusedadam": "FusedAdam", "cpulion": "DeepSpeedCPULion", "deepspeedcpulion": "DeepSpeedCPULion",
            "fusedlion": "FusedLion", "cpuadagrad": "DeepSpeedCPUAdagrad",
            "deepspeedcpuadagrad": "DeepSpeedCPUAdagrad", "fusedlamb": "FusedLamb"}.get(name)


def deepspeed_optimizer_of(config) -> Optional[str]:
    """deepspeed_optimizer for a run whose config builds its optimizer (a client's optimizer
    is saved as torch keeps it, as DeepSpeed would)."""
    cfg = config.optimizer
    if cfg is None:
        return None
    return deepspeed_optimizer(cfg.type, cfg.params, config.zero_optimization.offload_optimizer_device != "none")


# -- reading --------------------------------------------------------------------------------
def _step_count(v: Any, where: str) -> float:
    if torch.is_tensor(v) and v.numel() == 1:
        return float(v)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise CheckpointError(f"{where}: optimizer state 'step' is {type(v).__name__}, not a step count")


def _is_tensor_state(v: Any) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 or isinstance(v, dict)  # a shard keeps {name: tensor}


def _all_zero(v: Any) -> bool:
    values = v.values() if isinstance(v, dict) else [v]
    return all(not bool(t.any()) for t in values)


def _keys_into(state: Dict[str, Any], form: StateForm, where: str) -> Dict[str, Any]:
    """One parameter's (or one shard group's) state with the family's key names, checked."""
    aliases = _ALIASES.get(form.family, {})
    out: Dict[str, Any] = {}
    for k, v in state.items():
        if k == "step":
            continue
        name = aliases.get(k, k) if aliases.get(k) not in state else k
        if name in form.keys:
            out[name] = v
        elif k in _INERT.get(form.family, ()) and _all_zero(v):
            continue
        else:
            raise CheckpointError(f"{where}: optimizer state {k!r} is not one {form.family} keeps "
                                  f"({', '.join(sorted(form.keys | {'step'}))}); was it saved with another optimizer?")
    for k in sorted(form.keys):
        if k not in out:
            raise CheckpointError(f"{where}: optimizer state lacks {k!r}, which {form.family} keeps (the saved "
                                  f"state has {', '.join(sorted(state)) or 'nothing'})")
    return out


def _group_hyper(saved: Mapping[str, Any], current: Mapping[str, Any]) -> Dict[str, Any]:
    """The saved hyperparameters this optimizer's groups have (lr, betas, ...): the config
    decides the rest (another optimizer's bias_correction, FusedAdam's meaningless step)."""
    return {k: v for k, v in saved.items() if k in current and k != "params"}


def _torch_state_dict(sd: Dict[str, Any], forms: List[Optional[StateForm]], groups: List[Dict[str, Any]],
                      where: str) -> Dict[str, Any]:
    state, out_groups = sd.get("state", {}), []
    new_state: Dict[Any, Dict[str, Any]] = {}
    for gi, g in enumerate(sd["param_groups"]):
        ids = list(g["params"])
        current = groups[gi] if gi < len(groups) else {}
        form = forms[gi] if gi < len(forms) else forms[-1]
        if form is not None and form.step_optional:  # Muon: its momentum, and a count if it kept one
            for i in ids:
                if state.get(i):
                    st = state[i]
                    new_state[i] = {**({"step": torch.tensor(_step_count(st["step"], where), dtype=torch.float32)}
                                       if "step" in st else {}), **_keys_into(st, form, f"{where} (parameter {i})")}
            out_groups.append({**{k: v for k, v in current.items() if k != "params"}, **_group_hyper(g, current),
                               "params": ids})
            continue
        steps = [_step_count(state[i]["step"], where) for i in ids if state.get(i) and "step" in state[i]]
        ints = any(not torch.is_tensor(state[i].get("step")) for i in ids if state.get(i))
        # DeepSpeed's fused optimizers step a group with its last parameter's count
        shared = max(steps) if ints and steps else None
        for i in ids:
            if not state.get(i):
                continue
            st = state[i]
            if "step" not in st and "step" not in g:
                raise CheckpointError(f"{where}: optimizer state of parameter {i} has no 'step'")
            count = shared if shared is not None else _step_count(st.get("step", g.get("step")), where)
            new_state[i] = {"step": torch.tensor(count, dtype=torch.float32),
                            **_keys_into(st, form, f"{where} (parameter {i})")}
        out_groups.append({**{k: v for k, v in current.items() if k != "params"}, **_group_hyper(g, current),
                           "params": ids})
    return {**sd, "state": new_state, "param_groups": out_groups}


def _shard(shard: Dict[str, Any], forms: List[Optional[StateForm]], groups: List[Dict[str, Any]], where: str
           ) -> Dict[str, Any]:
    new_groups = []
    for gi, g in enumerate(shard["groups"]):
        st = g.get("state") or {}
        form = forms[gi] if gi < len(forms) else forms[-1]
        if st and form.step_optional and "step" not in st:
            st = {"step": 0, **st}  # the count offload hosts keep beside the momentum
        if st:
            tensors = {k: v for k, v in st.items() if k == "step" or _is_tensor_state(v)}
            scalars = [k for k in st if k not in tensors]
            if scalars:
                raise CheckpointError(f"{where}: optimizer state {scalars[0]!r} is not one {form.family} keeps")
            if "step" not in st:
                raise CheckpointError(f"{where}: optimizer state of param group {gi} has no 'step'")
            st = {"step": torch.tensor(_step_count(st["step"], where), dtype=torch.float32),
                  **_keys_into(st, form, f"{where} (param group {gi})")}
        new_groups.append({**g, "state": st})
    out = {**shard, "groups": new_groups}
    if isinstance(shard.get("param_groups"), list) and groups:
        out["param_groups"] = [_group_hyper(h, groups[i] if i < len(groups) else {})
                               for i, h in enumerate(shard["param_groups"])]
    return out


def to_ours(optim: Any, optimizer: Optional[torch.optim.Optimizer], where: str) -> Any:
    """What load_checkpoint read (a stage-0 state {"optimizer": torch state_dict, ...}, one
    ZeRO shard, or a list of either) in `optimizer`'s form. `where` starts error lines."""
    forms = group_forms(optimizer)
    if forms is None or optim is None:
        return optim
    groups = optimizer.param_groups
    if isinstance(optim, list):
        return [to_ours(o, optimizer, where) for o in optim]
    if isinstance(optim, dict) and "groups" in optim:
        return _shard(optim, forms, groups, where)
    if isinstance(optim, dict) and isinstance(optim.get("optimizer"), dict) and "param_groups" in optim["optimizer"]:
        return {**optim, "optimizer": _torch_state_dict(optim["optimizer"], forms, groups, where)}
    return optim


# -- writing --------------------------------------------------------------------------------
def _param_state_for(state: Dict[str, Any], form: StateForm) -> Dict[str, Any]:
    out = {}
    for k, v in state.items():
        if k == "step" and form.int_step:
            out[k] = int(round(_step_count(v, "save_checkpoint")))
        else:
            out[form.names.get(k, k)] = v
    return out


def _group_for(group: Mapping[str, Any], form: StateForm) -> Dict[str, Any]:
    return {**{k: group.get(k, v) for k, v in form.group_defaults.items()}, **group}


def for_deepspeed_torch(sd: Dict[str, Any], ds_class: Optional[str]) -> Dict[str, Any]:
    """A torch state_dict (stage 0) as DeepSpeed's `ds_class` keeps it."""
    form = _DS_FORMS.get(ds_class or "")
    if form is None:
        return sd
    return {**sd, "state": {i: _param_state_for(st, form) for i, st in sd["state"].items()},
            "param_groups": [_group_for(g, form) for g in sd["param_groups"]]}


def for_deepspeed_group_state(state: Dict[str, Any], ds_class: Optional[str]) -> Dict[str, Any]:
    """One flat partition's state (ZeRO files) as DeepSpeed's `ds_class` keeps it."""
    form = _DS_FORMS.get(ds_class or "")
    return state if form is None else _param_state_for(state, form)


def for_deepspeed_groups(groups: List[Dict[str, Any]], ds_class: Optional[str]) -> List[Dict[str, Any]]:
    form = _DS_FORMS.get(ds_class or "")
    return groups if form is None else [_group_for(g, form) for g in groups]


__all__ = ["StateForm", "deepspeed_optimizer", "deepspeed_optimizer_of", "for_deepspeed_group_state", "for_deepspeed_groups",
           "group_forms",
           "for_deepspeed_torch", "form_of", "to_ours"]
