"""How many "devices" the CPU accelerator reports, counted as DeepSpeed's CPU accelerator counts.

DeepSpeed treats each NUMA node of a CPU host as one device, so that its launcher and its
tests start one rank per node. `device_count()` is:
1. LOCAL_SIZE when it is set to a positive number (DeepSpeed's launcher and its test harness
   set it to the number of local ranks), else
2. the number of NUMA nodes `numactl --hardware` lists, skipping nodes with no cores (HBM in
   flat mode) and a node whose core list repeats the one before it, else
3. 1, where numactl is missing or its output has no `available:` line.

numactl is asked, not /sys, because that is where DeepSpeed looks: the same host gives the
same count under both.
"""
from __future__ import annotations

import os
import subprocess
from typing import List

import torch


def parse_numactl_hardware(text: str) -> List[List[int]]:
    """The core list of each node in `numactl --hardware` output, in node order."""
    lines = text.splitlines()
    count = None
    for line in lines:
        if line.startswith("available:"):
            parts = line.split()
            if len(parts) > 1 and parts[1].isdigit():
                count = int(parts[1])
            break
    if count is None:
        return []
    nodes: List[List[int]] = []
    for node in range(count):
        prefix = f"node {node} cpus:"
        cores: List[int] = []
        for line in lines:
            if line.startswith(prefix):
                cores = [int(c) for c in line[len(prefix):].split() if c.isdigit()]
                break
        nodes.append(cores)
    return nodes


def get_numa_cores() -> List[List[int]]:
    """Each NUMA node's cores as numactl reports them; [] where numactl is missing or fails."""
    try:
        out = subprocess.run(["numactl", "--hardware"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return parse_numactl_hardware(out.stdout)


def numa_device_count(core_lists: List[List[int]]) -> int:
    """Nodes that have cores, a node repeating the previous node's cores counted once; 1 for none."""
    if not core_lists:
        return 1
    count, previous = 0, None
    for cores in core_lists:
        if cores and cores != previous:
            count += 1
            previous = cores
    return count


def cpu_device_count() -> int:
    raw = os.environ.get("LOCAL_SIZE", "").strip()
    try:
        local_size = int(raw) if raw else 0
    except ValueError:
        # DeepSpeed's int() raises here; one line naming the variable is the better answer
        raise ValueError(f"LOCAL_SIZE={raw!r} is not a whole number (it is the number of local ranks)") from None
    if local_size > 0:
        return local_size
    return numa_device_count(get_numa_cores())


def cpu_fp16_supported() -> bool:
    """Whether the CPU accelerator reports fp16 as supported: DeepSpeed's CPU accelerator asks
    oneDNN whether this processor has native fp16 kernels (AVX512-FP16/AMX-FP16), and so do we,
    so scripts that choose fp16 or bf16 from the answer choose as they would under DeepSpeed.
    (DeepSpeed answers None rather than False where oneDNN says no.)"""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
