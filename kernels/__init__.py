"""dslaunch.kernels: fused optimizer kernels (C++ SIMD CPU Adam, CUDA multi-tensor Adam)."""
