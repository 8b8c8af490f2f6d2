"""`deepspeed.compression.helper`: the module-path helpers DeepSpeed's compression scripts
import (replacing a layer found by its dotted name)."""


def recursive_getattr(model, module_name: str):
    """model's sub-module (or attribute) at the dotted path "layer.0.attn"."""
    obj = model
    for part in module_name.split("."):
        obj = getattr(obj, part)
    return obj


def recursive_setattr(model, module_name: str, module) -> None:
    """Replace model's sub-module at the dotted path with `module`."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)
