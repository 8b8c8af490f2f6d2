"""Write tests/data/ds_offload_activations.json: the stats DeepSpeed 0.19.8's
CheckpointHiddenStatesOffload counts on scripts/offload_activations_cases.py's cases (a chain
of four checkpointed Linear layers with their inputs marked, a pass-through network, views
with an offset, strides and stride 0, a retain_graph double backward, one context reused for
two steps), on the CPU and with the host standing in for a device so the offload path runs.
tests/runtime/train/test_offload_activations_vs_deepspeed.py replays them with dslaunch.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_offload_activations_fixtures.py \
        tests/data/ds_offload_activations.json
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.activation_checkpointing import offload_activations  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import offload_activations_cases as cases  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: make_ds_offload_activations_fixtures.py OUT.json")
    result = {"deepspeed": deepspeed.__version__, "cases": cases.run_all(offload_activations, get_accelerator())}
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1, sort_keys=True)
        fh.write("\n")
    print(f"wrote {sys.argv[1]}")


if __name__ == "__main__":
    main()
