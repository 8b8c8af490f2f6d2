"""AutoEP: a Hugging Face MoE model's expert blocks swapped for expert-parallel layers at
deepspeed.initialize, from the config's `expert_parallel` section (DeepSpeed 0.19's AutoEP).

    presets.py   the model families (DeepSpeed's presets) and how one is chosen
    detect.py    the model's MoE blocks and how each routes (LayerSpec); what cannot be split
    routing.py   token-choice top-k routing from the router's logits
    experts.py   this rank's experts (w1, w2, w3 stacked) and the expert MLP forms
    dispatch.py  the all-to-alls over the expert group
    layer.py     AutoEPMoELayer, which takes a block's place
    convert.py   the swap, and hf_state_dict (the model back in its Hugging Face layout)
    attach.py    what the engine calls (plan before the mesh, attach after it)

After training, `save_pretrained(engine, directory)` writes the model as Hugging Face's
`save_pretrained` would have before the swap, every expert gathered (a collective).
"""
from __future__ import annotations

from typing import Any

from .attach import Plan, attach, plan
from .convert import autoep_layers, hf_state_dict
from .detect import LayerSpec, detect
from .layer import AutoEPMoELayer
from .presets import PRESETS, AutoEPError


def save_pretrained(model_or_engine: Any, save_directory: str, **kwargs) -> bool:
    """Collective (every rank calls it): rank 0 writes `save_directory` with the Hugging Face
    model's save_pretrained, given the gathered state dict; returns whether this rank wrote."""
    from ...core import comm

    module = getattr(model_or_engine, "module", model_or_engine)
    state = hf_state_dict(module)
    if state is not None:
        module.save_pretrained(save_directory, state_dict=state, **kwargs)
    if comm.is_initialized():
        comm.barrier(group=comm.get_world_group(), label="autoep save_pretrained")
    return state is not None


__all__ = ["AutoEPError", "AutoEPMoELayer", "LayerSpec", "PRESETS", "Plan", "attach", "autoep_layers", "detect",
           "hf_state_dict", "plan", "save_pretrained"]
