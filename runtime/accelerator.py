"""`deepspeed.accelerator.get_accelerator()`: the device scripts should put tensors on.

CUDA when torch sees a GPU, else the CPU; scripts written for DeepSpeed call
`get_accelerator().device_name(local_rank)` and get "cuda:N" or "cpu".
"""
from __future__ import annotations

import torch


class _Accelerator:
    def __init__(self, cuda: bool):
        self._cuda = cuda
        self._name = "cuda" if cuda else "cpu"

    def device_name(self, device_index=None) -> str:
        if self._cuda and device_index is not None and device_index >= 0:
            return f"cuda:{device_index}"
        return self._name

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._cuda:
            torch.cuda.manual_seed_all(seed)


_ACCEL = None


def get_accelerator() -> _Accelerator:
    global _ACCEL
    if _ACCEL is None:
        _ACCEL = _Accelerator(torch.cuda.is_available())
    return _ACCEL
