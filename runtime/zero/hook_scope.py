"""Which parameters a ZeRO-3 module hook gathers: leaf modules and external parameters.

By default each module's hooks gather the parameters it owns directly. Two DeepSpeed APIs
widen that:

`set_z3_leaf_modules(model, classes)` (deepspeed.utils): a leaf module's whole subtree is
gathered in one collective when the leaf's forward starts and released when it ends; no hooks are placed on its descendants.
A leaf without a forward (a ModuleList: its parent's forward indexes it) is gathered by the
hooks of the module that holds it. Mixture-of-experts
layers need this: a router calls a different subset of experts on each rank and step, and
per-expert hooks would then issue a different number of collectives on each rank (a hang).
Accelerate marks the classes named in `transformer_moe_cls_names` this way.

Stage 3 refuses, in one line naming set_z3_leaf_modules, a model with a module outside any
leaf that holds its experts in a list attribute `experts` (transformers 4.x's Mixtral and
Qwen-MoE, remote-code MoE models): such a block calls only the experts that got tokens, and
without the leaf the ranks' ZeRO-3 gathers part ways at the first step where they route
differently (DeepSpeed 0.19.8 gathers mismatched experts, then fails that step).
transformers 5's fused experts (one 3D parameter per projection) need no leaf.

`register_external_parameter(module, param)` (deepspeed.zero): `param` belongs to another
module but `module`'s forward uses it (weight-norm convolutions in HF speech models), so
`module`'s hooks gather it too.
"""
from __future__ import annotations

import logging
import sys
from typing import Dict, Iterable, Iterator, List, Tuple, Type, Union

import torch

from ..core.config.zero import DEFAULT_LEAF_MODULE_CLASSES, DEFAULT_LEAF_MODULE_NAME_SUFFIXES, DEFAULT_LEAF_MODULE_NAMES

_log = logging.getLogger("dslaunch.runtime")

_FLAG = "_z3_leaf"


def _classes(leaf_module_classes: Iterable[Union[Type[torch.nn.Module], str]]) -> tuple:
    if isinstance(leaf_module_classes, (str, type)):
        return (leaf_module_classes,)
    return tuple(leaf_module_classes)


def _matches(module: torch.nn.Module, classes: tuple) -> bool:
    """A class given as a type matches its subclasses too; one given by name matches the exact
    class, by its plain name or module-qualified ("pkg.mod.Class", as the config's classes)."""
    names = {c for c in classes if isinstance(c, str)}
    types = tuple(c for c in classes if isinstance(c, type))
    cls = type(module)
    return (bool(types) and isinstance(module, types)) or cls.__name__ in names \
        or f"{cls.__module__}.{cls.__qualname__}" in names


def leaf_parameters(model: torch.nn.Module, stepped: Iterable[torch.nn.Parameter]
                    ) -> Dict[torch.nn.Module, List[torch.nn.Parameter]]:
    """DeepSpeed's stage-3 optimizer.leaf_parameters: each outermost leaf module (one inside
    another leaf is part of it) -> the parameters of its subtree that train, in the order of
    `stepped` (the optimizer's groups); a leaf with none is left out."""
    owner: Dict[int, torch.nn.Module] = {}

    def walk(m: torch.nn.Module) -> None:
        if getattr(m, _FLAG, False):
            for p in m.parameters():
                owner[id(p)] = m
            return
        for child in m.children():
            walk(child)

    walk(model)
    out: Dict[torch.nn.Module, List[torch.nn.Parameter]] = {}
    for p in stepped:
        if p.requires_grad and id(p) in owner:
            out.setdefault(owner[id(p)], []).append(p)
    return out


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                        ) -> List[torch.nn.Module]:
    """Mark every submodule of `model` whose class is one of `leaf_module_classes` (classes or
    class names) as a ZeRO-3 leaf; returns the marked modules. Call before deepspeed.initialize."""
    classes = _classes(leaf_module_classes)
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        names = ", ".join(c if isinstance(c, str) else c.__name__ for c in classes)
        raise ValueError(f"set_z3_leaf_modules: no module of class {names} in {type(model).__name__}")
    for m in found:
        setattr(m, _FLAG, True)
    return found


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                          ) -> List[torch.nn.Module]:
    classes = _classes(leaf_module_classes)
    found = [m for m in model.modules() if _matches(m, classes)]
    if not found and raise_if_not_found:
        raise ValueError(f"unset_z3_leaf_modules: no module of the given classes in {type(model).__name__}")
    for m in found:
        if hasattr(m, _FLAG):
            delattr(m, _FLAG)
    return found


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Iterable[str], flag: bool = True,
                                raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """Set (or, flag False, clear) the leaf mark of the submodules named in `module_names` (names
    as model.named_modules() gives them); returns (the modules, the names not found). A name not
    found is a ValueError unless raise_if_not_found is False."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        setattr(module, _FLAG, flag)
        found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_name: no module named {missing} in {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Iterable[str], flag: bool = True,
                                  raise_if_not_found: bool = True) -> Tuple[List[torch.nn.Module], List[str]]:
    """As set_z3_leaf_modules_by_name, for every submodule whose name ends with one of
    `module_name_suffixes`; each module is returned once, the suffixes matching none are missing."""
    found, missing, seen = [], [], set()
    for suffix in module_name_suffixes:
        hit = False
        for name, module in model.named_modules():
            if name.endswith(suffix):
                hit = True
                setattr(module, _FLAG, flag)
                if id(module) not in seen:
                    seen.add(id(module))
                    found.append(module)
        if not hit:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"set_z3_leaf_modules_by_suffix: no module name ends with {missing} in "
                         f"{type(model).__name__}")
    return found, missing


def apply_leaf_module_config(model: torch.nn.Module, cfg) -> List[torch.nn.Module]:
    """Mark the leaves `zero_optimization.leaf_module` names (a LeafModuleConfig), as the engine
    does when it is built; returns the marked modules, each once. Names or suffixes the user
    gave that match nothing are logged as a warning (DeepSpeed's behaviour), not an error: the
    default classes match nothing in most models."""
    if cfg is None:
        return []
    marked, seen = [], set()

    def keep(modules):
        for m in modules:
            if id(m) not in seen:
                seen.add(id(m))
                marked.append(m)

    if cfg.classes:
        keep(set_z3_leaf_modules(model, cfg.classes, raise_if_not_found=False))
    if cfg.names:
        found, missing = set_z3_leaf_modules_by_name(model, cfg.names, raise_if_not_found=False)
        keep(found)
        if missing and cfg.names != DEFAULT_LEAF_MODULE_NAMES:
            _log.warning("zero_optimization.leaf_module.names: no module named %s in the model", missing)
    if cfg.name_suffixes:
        found, missing = set_z3_leaf_modules_by_suffix(model, cfg.name_suffixes, raise_if_not_found=False)
        keep(found)
        if missing and cfg.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES:
            _log.warning("zero_optimization.leaf_module.name_suffixes: no module name ends with %s", missing)
    customized = (cfg.classes != DEFAULT_LEAF_MODULE_CLASSES or cfg.names != DEFAULT_LEAF_MODULE_NAMES
                  or cfg.name_suffixes != DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    if not marked and customized:
        _log.warning("zero_optimization.leaf_module matched no module; every module keeps its own hooks")
    return marked


def z3_leaf_module(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _FLAG, False))


def get_z3_leaf_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


# DeepSpeed's attribute: {id(parameter): parameter} on every module of a stage-3 model
# (init_external_params), which scripts and DeepSpeed's tests read to see where a parameter
# used outside its owner was registered
_EXTERNAL = "_external_params"
# bumped on every (un)registration: stage 3 caches module_params per module and rebuilds the
# cache when this moves, so a registration made after deepspeed.initialize still counts
registrations = 0


def init_external_params(module: torch.nn.Module) -> None:
    """Give `module` its (empty) registry of external parameters, as DeepSpeed's initialize does
    for every module of a stage-3 model."""
    module.__dict__.setdefault(_EXTERNAL, {})


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: expected a torch.nn.Parameter, got {type(parameter).__name__}")
    global registrations
    ext = module.__dict__.setdefault(_EXTERNAL, {})
    if id(parameter) not in ext:
        ext[id(parameter)] = parameter
        registrations += 1


def is_external_to(module: torch.nn.Module, parameter: torch.nn.Parameter) -> bool:
    return id(parameter) in module.__dict__.get(_EXTERNAL, {})


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    ext = module.__dict__.get(_EXTERNAL, {})
    if id(parameter) not in ext:
        raise ValueError("unregister_external_parameter: this parameter was not registered with the module")
    global registrations
    del ext[id(parameter)]
    registrations += 1


def _runs_forward(m: torch.nn.Module) -> bool:
    """False for torch's containers without a forward (ModuleList, ModuleDict, ParameterList...):
    their hooks never fire, the parent's forward indexes them."""
    return type(m).forward is not torch.nn.Module.forward


def _adopted(m: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters of the leaves below m that cannot run a forward (a ModuleList marked as a
    leaf, reached through containers that are not leaves either). m's hooks gather them: the
    leaf's own would never fire. DeepSpeed finds such parameters when the forward first reads
    them (its parameter getter registers them on the running module), gathering only those
    read; gathering the whole leaf up front issues the same collectives on every rank whatever
    each one reads, so a router that reads different experts per rank cannot hang."""
    out: List[torch.nn.Parameter] = []
    for c in m.children():
        if _runs_forward(c):
            continue
        if z3_leaf_module(c):
            out.extend(c.parameters())
        else:
            out.extend(_adopted(c))
    return out


def module_params(m: torch.nn.Module) -> List[torch.nn.Parameter]:
    """What m's hooks gather: its own parameters (its whole subtree for a leaf), those of the
    forward-less leaves it holds (_adopted) and external ones."""
    own = list(m.parameters(recurse=z3_leaf_module(m)))
    if not z3_leaf_module(m) and _runs_forward(m):
        for p in _adopted(m):
            if all(p is not q for q in own):  # a parameter tied between the leaf and m counts once
                own.append(p)
    return own + [p for p in m.__dict__.get(_EXTERNAL, {}).values() if all(p is not q for q in own)]


def _units(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """(name, module) of every module outside any leaf's subtree, and of each leaf itself (a leaf
    counts as one module: what is below it is not visited)."""
    inside = set()
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        if z3_leaf_module(m):
            inside.update(id(c) for c in m.modules())
        yield name, m


def hooked_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules stage 3 hooks: leaves that run a forward, and modules outside any leaf that
    have parameters to gather (a forward-less leaf's go to the module holding it)."""
    return [m for _, m in _units(model) if not (z3_leaf_module(m) and not _runs_forward(m)) and module_params(m)]


def tracked_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every module stage 3 keeps on its stack of running modules: the units (_units) that run a
    forward."""
    return [m for _, m in _units(model) if _runs_forward(m)]


def unmarked_expert_lists(model: torch.nn.Module) -> List[tuple]:
    """(name, class name) of the modules outside any leaf whose `experts` is a ModuleList of modules with
    parameters: routers that call only the experts with tokens need such a module as a leaf."""
    out = []
    for name, m in _units(model):
        if z3_leaf_module(m):
            continue
        experts = getattr(m, "experts", None)
        if isinstance(experts, torch.nn.ModuleList) and sum(1 for e in experts if next(e.parameters(), None) is not None) > 1:
            out.append((name or type(m).__name__, type(m).__name__))
    return out


# -- stage3_module_granularity_threshold: small modules as leaves ----------------------------
# DeepSpeed's rule: a module's granularity is its parameter count over the number of modules
# with parameters in its subtree (itself included); modules without children or parameters,
# torch's containers (ModuleList, Sequential, ...) and subtrees over 1e9 parameters never
# qualify. From the root down, the first module whose granularity is at most the threshold
# becomes a leaf (its subtree gathered in one collective, saving the per-module hooks); the
# results are unchanged, only how often parameters are gathered.
_NEVER = sys.maxsize
_MAX_LEAF_PARAMS = 1e9
_CONTAINERS = frozenset(torch.nn.modules.container.__all__)


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a partitioned parameter's full size


def module_granularity(model: torch.nn.Module) -> Dict[int, int]:
    """{id(module): granularity} for every module of `model` (sys.maxsize where it never qualifies)."""
    out: Dict[int, int] = {}

    def visit(m: torch.nn.Module) -> Tuple[int, int]:  # (modules with parameters, parameters) below m
        if not any(True for _ in m.parameters()):
            out[id(m)] = _NEVER
            return 0, 0
        params = sum(_numel(p) for p in m.parameters(recurse=False))
        children = list(m.children())
        if not children:
            out[id(m)] = _NEVER
            return 1, params
        layers = 0
        for c in children:
            n_layers, n_params = visit(c)
            layers, params = layers + n_layers, params + n_params
        if type(m).__name__ in _CONTAINERS:
            out[id(m)] = _NEVER
            return layers, params
        layers += 1
        out[id(m)] = params // layers if params <= _MAX_LEAF_PARAMS else _NEVER
        return layers, params

    visit(model)
    return out


def set_leaves_by_granularity(model: torch.nn.Module, threshold: int) -> List[torch.nn.Module]:
    """Mark, from the root down, each module whose granularity is at most `threshold` as a leaf
    (not looking inside it further); returns the marked modules. A threshold below every
    module's granularity marks nothing and says in a warning which value would."""
    if threshold <= 0:
        return []
    granularity = module_granularity(model)
    smallest = min(granularity.values(), default=_NEVER)
    if smallest > threshold:
        if smallest != _NEVER:
            _log.warning("zero_optimization.stage3_module_granularity_threshold %d marks no module: the smallest "
                         "granularity is %d", threshold, smallest)
        return []
    marked: List[torch.nn.Module] = []

    def visit(m: torch.nn.Module) -> None:
        if not any(True for _ in m.parameters()):
            return
        if granularity[id(m)] <= threshold:
            setattr(m, _FLAG, True)
            marked.append(m)
            return
        for c in m.children():
            visit(c)

    visit(model)
    return marked
