"""deepspeed.checkpoint.utils: clone_tensors_for_torch_save (Accelerate's get_state_dict uses it)
and get_model_ckpt_name_for_rank (the model-states file of a tag folder)."""
from __future__ import annotations

import os

import torch


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank `mp_rank_str` (already zero-padded, as
    DeepSpeed takes it) in the tag folder `base_folder`; the name save_checkpoint writes."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """A copy of `item` (tensors, or lists/tuples/dicts of them) whose tensors own compact
    storage on `device`: torch.save of a view otherwise writes its whole base storage (ZeRO
    stages 1-2 hand out parameters that are views into one flat buffer)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
