"""Write tests/data/ds_offload_states.json: what DeepSpeed 0.19.8 answers for
scripts/offload_states_cases.py's cases: which states engine.offload_states moves for a
given include list, stage and offload_optimizer (its engine's own include filter, asked
with the two settings it reads); zero.Init's one-rank-group check (message or none, and
the WORLD_SIZE it names); and the block count CUDAQuantizer.quantize picks for n elements,
with the dtype its op is handed (a recording op stands in for the CUDA build, which a CPU
machine lacks). tests/runtime/zero/test_offload_states_vs_deepspeed.py replays them.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_offload_states_fixtures.py \
        tests/data/ds_offload_states.json
"""
import json
import os
import re
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import offload_states_cases as cases  # noqa: E402


class _Settings:
    """The two engine settings DeepSpeedEngine._refine_include_states reads."""

    def __init__(self, stage, host):
        self.stage, self.host = stage, host

    def zero_use_cpu_optimizer(self):
        return self.host

    def zero_optimization_partition_weights(self):
        return self.stage == 3


def include_case(stage, host, include):
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    kinds = None if include is None else [OffloadStateTypeEnum(k) for k in include]
    return [k.value for k in DeepSpeedEngine._refine_include_states(_Settings(stage, host), kinds)]


def pg_case(world, explicit, env):
    from deepspeed.runtime.zero.partition_parameters import _contradicting_single_rank_pg_error

    msg = _contradicting_single_rank_pg_error(dp_world_size=world, explicit_process_group=object() if explicit else
                                              None, env=env)
    if msg is None:
        return None
    return {"world_size_named": int(re.search(r"WORLD_SIZE=(\d+)", msg).group(1)),
            "names_init_distributed": "init_distributed" in msg}


def quantizer_case(n):
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

    op = cases.RecordingQuantizerOp()
    CUDAQuantizer.quantizer_cuda_module = op  # set: its constructor builds nothing
    CUDAQuantizer.group_size_cache.clear()
    CUDAQuantizer().quantize(torch.ones(n, dtype=torch.bfloat16))
    return op.calls[0]


def main():
    out = {"deepspeed": deepspeed.__version__,
           "include": {name: include_case(*c) for name, c in cases.INCLUDE_CASES.items()},
           "pg": {name: pg_case(*c) for name, c in cases.PG_CASES.items()},
           "quantizer": {str(n): quantizer_case(n) for n in cases.QUANTIZER_NUMELS}}
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
