"""Values in the shape a JSON recording of DeepSpeed holds them, so a live value compares
equal to its recorded one: tuples and torch.Size become lists, nested through dicts."""
import torch


def as_recorded(value):
    if isinstance(value, dict):
        return {k: as_recorded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, torch.Size)):
        return [as_recorded(v) for v in value]
    return value
