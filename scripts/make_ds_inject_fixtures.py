"""Write tests/data/ds_inject.json: DeepSpeed 0.19.8's shard sizes (deepspeed.module_inject.
tp_shard: AutoTPMeta.from_model_config and get_shard_size_list / get_shard_size) and fused
expert layouts (deepspeed.moe.fused_expert_layout) and Hugging Face tp plans
(deepspeed.runtime.tensor_parallel.config._get_hf_tp_plan), AutoTP's layer-spec objects
(deepspeed.module_inject.autotp_config) and tp-plan converter (tp_plan_converter) for the cases in scripts/ds_inject_cases.py;
tests/runtime/tensor_parallel/test_module_inject_ds.py holds dslaunch's against them.

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
from deepspeed.module_inject.autotp_config import AutoTPConfig, TPLayerSpec, merge_autotp_configs
from deepspeed.module_inject.tp_plan_converter import TPPlanConverter

sys.path.insert(0, os.path.dirname(__file__))
from ds_inject_cases import (HF_PLANS, LAYOUT_CASES, MATCH_NAMES, SHAPE_CASES, SHARD_CASES, SPEC_DICTS,  # noqa: E402
                             config_cases, plan_models)  # noqa: E402  shared with the test


def spec_json(s):
    return {"patterns": list(s.patterns), "partition_type": s.partition_type.value, "shape": s.shape,
            "partition_dim": s.partition_dim, "model_types": s.model_types, "gather_output": s.gather_output,
            "grad_allreduce": s.grad_allreduce, "dim": s.get_partition_dim(), "unequal": s.has_unequal_sub_params(),
            "sizes": s.get_sub_param_sizes(), "count": s.get_num_sub_params()}


def config_json(c):
    return {"tp_size": c.tp_size, "layer_specs": [spec_json(s) for s in c.layer_specs],
            "embedding_partition_dim": c.embedding_partition_dim, "lm_head_patterns": c.lm_head_patterns,
            "use_default_specs": c.use_default_specs, "strict_mode": c.strict_mode}


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
    converted = []
    for plan in HF_PLANS:
        try:
            specs = TPPlanConverter.convert(plan)
            converted.append(None if specs is None else [spec_json(s) for s in specs])
        except ValueError as exc:
            converted.append({"error": str(exc)})
    configs = []
    for d in SPEC_DICTS:
        c = AutoTPConfig.from_dict(d)
        found = [c.find_matching_spec(n, t) for n, t in MATCH_NAMES]
        configs.append({"config": config_json(c),
                        "matches": [None if f is None else c.layer_specs.index(f) for f in found]})
    merged = config_json(merge_autotp_configs(AutoTPConfig.from_dict(SPEC_DICTS[1]), AutoTPConfig.from_dict(SPEC_DICTS[0])))
    shapes = []
    for shape, ptype, dim in SHAPE_CASES:
        try:
            shapes.append(spec_json(TPLayerSpec(patterns=["x"], partition_type=ptype, shape=shape, partition_dim=dim)))
        except ValueError as exc:
            shapes.append({"error": str(exc)})
    plans = {name: _get_hf_tp_plan(model) for name, model in plan_models().items()}
    with open(sys.argv[1], "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "shards": shards, "layouts": layouts, "metas": metas,
                   "plans": plans, "converted": converted, "configs": configs, "merged": merged,
                   "shapes": shapes}, fh,
                  indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
