"""`deepspeed.accelerator.get_accelerator()`: the device scripts should put tensors on, and
the device calls DeepSpeed scripts make through it.

CUDA when torch sees a GPU, else the CPU; scripts written for DeepSpeed call
`get_accelerator().device_name(local_rank)` and get "cuda:N" or "cpu". The rest of the
object is what Megatron-DeepSpeed, DeepSpeedExamples and Hugging Face call on it (counted by
scripts/deepspeed_api_surface.py's scan): memory figures, seeding and RNG state, typed
tensor constructors (`get_accelerator().FloatTensor([...])`), pinning. On the CPU, memory
figures are the process's resident set (peak: its high-water mark), as DeepSpeed's CPU
accelerator reports them.
"""
from __future__ import annotations

import functools
import resource
from typing import Callable, Optional

import torch

from .cpu_devices import cpu_device_count, cpu_fp16_supported


class DeepSpeedAccelerator:
    """One accelerator, CUDA or CPU (DeepSpeed's name for the interface)."""

    def __init__(self, cuda: bool):
        self._cuda = cuda
        self._name = "cuda" if cuda else "cpu"
        self._communication_backend_name = "nccl" if cuda else "gloo"

    # -- devices ----------------------------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        if self._cuda and device_index is not None and device_index >= 0:
            return f"cuda:{device_index}"
        return self._name

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def set_device(self, device_index) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """CUDA's GPU count; on the CPU, LOCAL_SIZE, else the NUMA node count (cpu_devices.py)."""
        return torch.cuda.device_count() if self._cuda else cpu_device_count()

    def is_available(self) -> bool:
        return True

    # -- profiler ranges (deepspeed.utils.nvtx's instrument_w_nvtx) ----------------------------
    def range_push(self, msg: str):
        """Open a named range in the CUDA profiler's timeline (NVTX); nothing on the CPU."""
        return torch.cuda.nvtx.range_push(msg) if self._cuda else None

    def range_pop(self):
        """Close the innermost range range_push opened; nothing on the CPU."""
        return torch.cuda.nvtx.range_pop() if self._cuda else None

    def is_synchronized_device(self) -> bool:
        """True where work runs in program order (the CPU), so no stream waits are needed."""
        return not self._cuda

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """CUDA: always; the CPU: where oneDNN has native fp16 kernels, as DeepSpeed's CPU accelerator says."""
        return True if self._cuda else cpu_fp16_supported()

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self):
        """The dtypes DeepSpeed's accelerator of the same kind lists (its tests parametrize over them)."""
        if self._cuda:
            return [torch.float32, torch.float16, torch.bfloat16]
        return [torch.float32, torch.bfloat16] + ([torch.float16] if cpu_fp16_supported() else [])

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def lazy_call(self, callback: Callable) -> None:
        """Run `callback` once the device is initialised (CUDA defers it; the CPU runs it now)."""
        if self._cuda:
            torch.cuda._lazy_call(callback)
        else:
            callback()

    # -- random numbers -----------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        if self._cuda:
            torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- memory -------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else _rss()

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else _peak_rss()

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else _rss()

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else _peak_rss()

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_peak_memory_stats(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index=None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": _rss(), "allocated_bytes.all.peak": _peak_rss()}

    def total_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import psutil

        return psutil.virtual_memory().total

    def available_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        import psutil

        return psutil.virtual_memory().available

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """Pinned on CUDA, counted by deepspeed.utils.pin_memory_tracker; the CPU has nothing to pin.
        DS_PIN_MEMORY_BACKEND=native (DeepSpeed's mlock allocator) is refused, never ignored."""
        from .native_pinning import REASON, native_backend_selected

        if native_backend_selected():
            raise RuntimeError(REASON)
        if not self._cuda:
            return tensor
        from .pin_memory_tracker import track_pinned_memory

        pinned = tensor.pin_memory()
        track_pinned_memory(pinned.nbytes)
        return pinned

    def unpin_memory(self, tensor: torch.Tensor):
        """None: torch frees pinned memory when the tensor goes (nothing to release by hand),
        as DeepSpeed's torch backend answers; the native backend is refused as in pin_memory."""
        from .native_pinning import REASON, native_backend_selected

        if native_backend_selected():
            raise RuntimeError(REASON)
        return None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    # -- typed tensor constructors (`get_accelerator().FloatTensor([1.0])`) -----------------------
    def _typed(self, dtype) -> Callable[..., torch.Tensor]:
        return functools.partial(torch.tensor, dtype=dtype, device=self._name)

    BFloat16Tensor = property(lambda self: self._typed(torch.bfloat16))
    ByteTensor = property(lambda self: self._typed(torch.uint8))
    DoubleTensor = property(lambda self: self._typed(torch.float64))
    FloatTensor = property(lambda self: self._typed(torch.float32))
    HalfTensor = property(lambda self: self._typed(torch.float16))
    IntTensor = property(lambda self: self._typed(torch.int32))
    LongTensor = property(lambda self: self._typed(torch.int64))


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class CPU_Accelerator(DeepSpeedAccelerator):
    """The CPU accelerator whatever torch sees (DeepSpeed's deepspeed.accelerator.cpu_accelerator
    class, which tests pass to set_accelerator to run on gloo on a GPU host). Its backend is
    always gloo: DeepSpeed switches to "ccl" when Intel's oneCCL bindings are installed, a
    backend dslaunch's comm layer does not speak."""

    def __init__(self):
        super().__init__(cuda=False)


_ACCEL: Optional[DeepSpeedAccelerator] = None
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]


def get_accelerator() -> DeepSpeedAccelerator:
    global _ACCEL
    if _ACCEL is None:
        _ACCEL = DeepSpeedAccelerator(torch.cuda.is_available())
    return _ACCEL


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Use `accel_obj` from now on (DeepSpeed lets tests and plug-ins swap it)."""
    global _ACCEL
    _ACCEL = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
