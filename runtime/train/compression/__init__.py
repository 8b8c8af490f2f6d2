"""Model compression (`compression_training`): sparse, row and head pruning and weight
quantization-aware training, on torch's parametrizations and pruning methods, with
`init_compression` / `redundancy_clean` as in DeepSpeed's deepspeed.compression.compress."""
from .compress import CompressionSchedule, compression_schedule, init_compression, redundancy_clean

__all__ = ["init_compression", "redundancy_clean", "compression_schedule", "CompressionSchedule"]
