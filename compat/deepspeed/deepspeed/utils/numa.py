"""`deepspeed.utils.numa`: get_numa_cores (the accelerator's, runtime/accelerator/cpu_devices.py) and
parse_range_list, DeepSpeed's parser of a core list such as "0,2-4,6".

The numbers and ranges are read by dslaunch's --bind_core_list parser (launcher/cores.py);
DeepSpeed's function also requires the pieces in ascending order without overlap, which
dslaunch's launcher does not (it keeps the order given), so that rule is checked here.
Errors are ValueErrors, as DeepSpeed's.
"""
from __future__ import annotations

from typing import List

from dslaunch.launcher.cores import parse_core_list
from dslaunch.runtime.accelerator.cpu_devices import get_numa_cores


def parse_range_list(range_str: str) -> List[int]:
    cores = parse_core_list(range_str, option="core list")
    if any(b <= a for a, b in zip(cores, cores[1:])):
        raise ValueError(f"core list {range_str!r}: ranges must be in ascending order and must not overlap")
    return cores


__all__ = ["parse_range_list", "get_numa_cores"]
