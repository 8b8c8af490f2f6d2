"""Write tests/data/ds_inject.json: DeepSpeed 0.19.8's shard sizes (deepspeed.module_inject.
tp_shard: AutoTPMeta.from_model_config and get_shard_size_list / get_shard_size) and fused
expert layouts (deepspeed.moe.fused_expert_layout) and Hugging Face tp plans
(deepspeed.runtime.tensor_parallel.config._get_hf_tp_plan) for the cases in scripts/ds_inject_cases.py;
tests/test_module_inject_ds.py holds dslaunch's against them.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_inject_fixtures.py tests/data/ds_inject.json
"""
import dataclasses
import json
import os
import sys

import deepspeed
from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size, get_shard_size_list
from deepspeed.moe.fused_expert_layout import classify_fused_gate_up_layout
from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

sys.path.insert(0, os.path.dirname(__file__))
from ds_inject_cases import LAYOUT_CASES, SHARD_CASES, config_cases, plan_models  # noqa: E402  shared with the test


def main():
    shards = []
    for total, tp, meta, name in SHARD_CASES:
        m = AutoTPMeta(**meta)
        shards.append({"list": get_shard_size_list(total, tp, m, name),
                       "each": [get_shard_size(total, tp, m, name, rank) for rank in range(tp)]})
    layouts = []
    for w1, w2 in LAYOUT_CASES:
        found = classify_fused_gate_up_layout(w1, w2)
        layouts.append(None if found is None else dataclasses.asdict(found))
    metas = {name: dataclasses.asdict(AutoTPMeta.from_model_config(cfg, tp_grain_size=8))
             for name, cfg in config_cases().items()}
    metas["none"] = dataclasses.asdict(AutoTPMeta.from_model_config(None))
    plans = {name: _get_hf_tp_plan(model) for name, model in plan_models().items()}
    with open(sys.argv[1], "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "shards": shards, "layouts": layouts, "metas": metas,
                   "plans": plans}, fh,
                  indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
