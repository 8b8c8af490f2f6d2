"""Make tests/data/ds_cpu_device_count.json: what DeepSpeed's CPU accelerator's device_count()
answers for each LOCAL_SIZE / `numactl --hardware` case of CASES.

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_cpu_device_count_fixture.py

Each case runs in a fresh process with a fake `numactl` first on PATH that prints the case's
output (or no numactl at all), so the answer is DeepSpeed's own reading of that output.
Also the dtypes it reports (is_fp16_supported, is_bf16_supported, supported_dtypes) with
oneDNN's fp16 answer on the recording machine, which they follow from.
Where DeepSpeed raises (numactl output without an `available:` line leaves its node count
unset), the case records the error; dslaunch answers 1 there, as for no numactl.
tests/runtime/core/test_accelerator_cpu_devices.py replays the cases against dslaunch's accelerator.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "ds_cpu_device_count.json")

ONE_NODE = "available: 1 nodes (0)\nnode 0 cpus: 0 1 2 3\nnode 0 size: 16000 MB\nnode 0 free: 8000 MB\n"
TWO_NODES = ("available: 2 nodes (0-1)\nnode 0 cpus: 0 1 2 3\nnode 0 size: 16000 MB\n"
             "node 1 cpus: 4 5 6 7\nnode 1 size: 16000 MB\nnode distances:\nnode   0   1\n")
# HBM in flat mode: nodes 2 and 3 hold memory and no cores
HBM_FLAT = ("available: 4 nodes (0-3)\nnode 0 cpus: 0 1\nnode 0 size: 1 MB\nnode 1 cpus: 2 3\n"
            "node 1 size: 1 MB\nnode 2 cpus:\nnode 2 size: 1 MB\nnode 3 cpus:\nnode 3 size: 1 MB\n")
REPEATED = ("available: 3 nodes (0-2)\nnode 0 cpus: 0 1\nnode 1 cpus: 0 1\nnode 2 cpus: 2 3\n")
FOUR_NODES = "".join(["available: 4 nodes (0-3)\n"] + [f"node {n} cpus: {2 * n} {2 * n + 1}\n" for n in range(4)])

# name: (LOCAL_SIZE or None, numactl output or None for no numactl)
CASES = {
    "local_size_4": ("4", TWO_NODES),
    "local_size_2_no_numactl": ("2", None),
    "local_size_0_falls_to_numa": ("0", TWO_NODES),
    "no_local_size_one_node": (None, ONE_NODE),
    "no_local_size_two_nodes": (None, TWO_NODES),
    "no_local_size_four_nodes": (None, FOUR_NODES),
    "hbm_flat_nodes_skipped": (None, HBM_FLAT),
    "repeated_core_list_once": (None, REPEATED),
    "no_numactl": (None, None),
    "numactl_without_available_line": (None, ""),
}

PROBE = "from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator; print(CPU_Accelerator().device_count())"


def run_case(local_size, numactl_out):
    """DeepSpeed's count, or {"raises": its last error line}."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
        # PATH holds only the fake numactl's folder (or an empty one) and the interpreter's
        env["PATH"] = os.pathsep.join([tmp, os.path.dirname(sys.executable)])
        if local_size is not None:
            env["LOCAL_SIZE"] = local_size
        if numactl_out is not None:
            with open(os.path.join(tmp, "output.txt"), "w") as fh:
                fh.write(numactl_out)
            fake = os.path.join(tmp, "numactl")
            with open(fake, "w") as fh:
                fh.write(f"#!/bin/sh\n/bin/cat {os.path.join(tmp, 'output.txt')}\n")
            os.chmod(fake, 0o755)
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
        if out.returncode != 0:
            return {"raises": out.stderr.strip().splitlines()[-1]}
        return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import deepspeed

    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    cases = {name: {"local_size": ls, "numactl": out, "device_count": run_case(ls, out)}
             for name, (ls, out) in CASES.items()}
    # the dtypes it reports on this machine, beside oneDNN's fp16 answer they follow from
    accel = CPU_Accelerator()
    dtypes = {"mkldnn_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
              "is_fp16_supported": accel.is_fp16_supported(), "is_bf16_supported": accel.is_bf16_supported(),
              "supported_dtypes": [str(d) for d in accel.supported_dtypes()]}
    with open(OUT, "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases, "dtypes": dtypes}, fh, indent=1)
        fh.write("\n")
    for name, case in cases.items():
        print(name, case["device_count"])


if __name__ == "__main__":
    main()
