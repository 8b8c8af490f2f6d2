"""`deepspeed.runtime.swap_tensor`: MIN_SWAPPABLE_BYTES, the size from which DeepSpeed's NVMe
offload swaps a tensor to its file (1 MiB; smaller ones stay in memory there). Scripts size
tensors by it so that they are swapped; dslaunch's NVMe offload (zero/offload.py,
zero/param_swap.py) swaps tensors of every size, so a tensor of at least this size is swapped
under both."""
MIN_SWAPPABLE_BYTES = 1024 ** 2

__all__ = ["MIN_SWAPPABLE_BYTES"]
