"""`deepspeed.utils.torch`: torch version checks as DeepSpeed's tests and scripts call them."""
import torch as _torch
from torch.torch_version import TorchVersion as _Version


def required_torch_version(min_version=None, max_version=None) -> bool:
    """True if the running torch is at least min_version and at most max_version."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version or max_version")
    running = _Version(_torch.__version__.split("+")[0])
    if min_version is not None and running < str(min_version):
        return False
    if max_version is not None and running > str(max_version):
        return False
    return True
