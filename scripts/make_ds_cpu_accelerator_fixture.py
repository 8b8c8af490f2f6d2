"""Make tests/data/ds_cpu_accelerator.json: what DeepSpeed 0.19.8's CPU accelerator class
(deepspeed.accelerator.cpu_accelerator.CPU_Accelerator) answers to the device calls scripts and
DeepSpeed's own tests make on it, and that set_accelerator(CPU_Accelerator()) makes it the one
get_accelerator() returns.

    DS_ACCELERATOR=cpu LOCAL_SIZE=2 /work/ds-venv/bin/python scripts/make_ds_cpu_accelerator_fixture.py

Recorded with Intel's oneCCL bindings absent (DeepSpeed's backend is then gloo; with them it
would be "ccl", which dslaunch does not speak: the fixture records which case it was).
tests/runtime/core/test_accelerator_cpu_class.py replays the calls against dslaunch's class.
"""
from __future__ import annotations

import importlib.util
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "data", "ds_cpu_accelerator.json")

# call name -> (method, positional arguments); answers are recorded as str()
CALLS = {
    "device_name()": ("device_name", ()),
    "device_name(0)": ("device_name", (0, )),
    "device_name(1)": ("device_name", (1, )),
    "current_device_name()": ("current_device_name", ()),
    "device(0)": ("device", (0, )),
    "current_device()": ("current_device", ()),
    "device_count()": ("device_count", ()),
    "communication_backend_name()": ("communication_backend_name", ()),
    "is_synchronized_device()": ("is_synchronized_device", ()),
    "is_available()": ("is_available", ()),
    "is_bf16_supported()": ("is_bf16_supported", ()),
}


def main() -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    cpu = CPU_Accelerator()
    answers = {name: str(getattr(cpu, method)(*args)) for name, (method, args) in CALLS.items()}
    answers["on_accelerator(cpu tensor)"] = str(cpu.on_accelerator(torch.zeros(1)))
    set_accelerator(cpu)
    out = {
        "deepspeed": deepspeed.__version__,
        "local_size": os.environ.get("LOCAL_SIZE"),
        "oneccl_bindings": importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None,
        "calls": answers,
        "set_accelerator_is_get_accelerator": get_accelerator() is cpu,
    }
    with open(OUT, "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
