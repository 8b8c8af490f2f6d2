"""Whole-model weights from a live engine: what `save_model` / `save_pretrained` need.

Under ZeRO-3 no rank holds the whole model, so the weights are gathered one module at a
time (a collective every rank must join) and copied to CPU on rank 0 only, so rank 0 never
holds more than one module's full parameters on the device at once. A parameter used
under two names (tied embeddings) is one tensor under both names, as in
`module.state_dict()`. Tensors keep the engine's compute dtype (bf16/fp16, or fp32):
DeepSpeed's "16bit" names are kept for its callers.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..core import comm
from ..zero.params import GatheredParameters

log = logging.getLogger("dslaunch.runtime")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gathered_state_dict(module: torch.nn.Module, exclude_frozen_parameters: bool = False
                        ) -> Optional[Dict[str, torch.Tensor]]:
    """Collective. The full state_dict (CPU tensors) on rank 0; None on the other ranks."""
    out: Optional[Dict[str, torch.Tensor]] = OrderedDict() if _rank() == 0 else None
    first_name: Dict[int, str] = {}

    def visit(m: torch.nn.Module, prefix: str) -> None:
        with GatheredParameters(list(m.parameters(recurse=False))):
            if out is not None:
                for name, p in m._parameters.items():
                    if p is None or (exclude_frozen_parameters and not p.requires_grad):
                        continue
                    key = prefix + name
                    if id(p) in first_name:
                        out[key] = out[first_name[id(p)]]
                    else:
                        out[key] = p.detach().to("cpu", copy=True)
                        first_name[id(p)] = key
                for name, b in m._buffers.items():
                    if b is not None and name not in m._non_persistent_buffers_set:
                        out[prefix + name] = b.detach().to("cpu", copy=True)
        for name, child in m.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return out


def tensor_parallel_state_dict(module: torch.nn.Module) -> Optional[Dict[str, torch.Tensor]]:
    """Collective over every tensor-parallel layer's group. The full (unsplit) state_dict of a
    model holding tensor-parallel layers, as CPU tensors, on rank 0; None on the other ranks."""
    from ..tensor_parallel import full_state_dict

    full = full_state_dict(module)
    if _rank() != 0:
        return None
    return OrderedDict((key, t.detach().to("cpu", copy=True)) for key, t in full.items())


def save_16bit_model(engine, save_dir: str, save_filename: str, exclude_frozen_parameters: bool) -> bool:
    """Collective. Rank 0 writes save_dir/save_filename (torch.save of the full state_dict).
    Under ZeRO-3 only when zero_optimization.stage3_gather_16bit_weights_on_model_save is true
    (gathering is costly, so it is opt-in as in DeepSpeed); returns whether a file was written."""
    path = os.path.join(str(save_dir), save_filename)
    from ..moe import autoep

    if autoep.autoep_layers(engine.module):
        # AutoEP: every expert gathered, under the model's own keys (DeepSpeed 0.19.8 writes rank 0's
        # module state, its share of the experts only, which no model can load)
        state = autoep.hf_state_dict(engine.module, exclude_frozen_parameters)
    elif engine.zero_optimization_stage() == 3:
        if not engine.zero_gather_16bit_weights_on_model_save():
            log.warning("save_16bit_model: did not save %s: zero_optimization.stage3_gather_16bit_weights_on_model_save "
                        "is false", path)
            return False
        state = gathered_state_dict(engine.module, exclude_frozen_parameters)
    else:
        state = None
        if _rank() == 0:
            frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad} \
                if exclude_frozen_parameters else set()
            state = {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()
                     if k not in frozen}
    if state is not None:
        os.makedirs(str(save_dir), exist_ok=True)
        torch.save(state, path + ".part")
        os.replace(path + ".part", path)
    # the world: every rank of the job called save (a collective)
    comm.barrier(group=comm.get_world_group(), label="save_16bit_model")
    return True
