"""The CPU kernel paths every process of the test session computes on.

DeepSpeed's answers in tests/data were recorded on AVX2 machines. On a machine with AVX-512
(with AVX512-BF16 or AMX) torch's CPU kernels take other code paths whose rounding differs in
the last bits: Muon's bf16 Newton-Schulz steps moved a loss by 4e-5, an fp32 GEMM moved a
weight past its tolerance. So the session computes on the AVX2 paths the fixtures were made
with: oneDNN (bf16 matmul), MKL (fp32 GEMM) and ATen's vectorised kernels. conftest sets the
variables before torch loads, every local process inherits them, and the SSH test cluster's
hosts (processes on this same machine, started by sshd) get them through sshd's SetEnv, so a
job spread over the hosts computes as its one-process reference does.
"""
import os

PINS = (("ONEDNN_MAX_CPU_ISA", "AVX2"), ("MKL_CBWR", "AVX2"), ("ATEN_CPU_CAPABILITY", "avx2"))


def pin_environment() -> None:
    """Set the pins in this process's environment; a variable already set wins."""
    for var, isa in PINS:
        os.environ.setdefault(var, isa)


def sshd_setenv() -> str:
    """The sshd_config line giving every SSH session this process's values of the pins."""
    pairs = [f"{var}={os.environ[var]}" for var, _ in PINS if os.environ.get(var)]
    return f"SetEnv {' '.join(pairs)}\n" if pairs else ""
