"""deepspeed.checkpoint.utils.clone_tensors_for_torch_save (Accelerate's get_state_dict uses it)."""
from __future__ import annotations

import torch


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
