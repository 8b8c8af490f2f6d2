"""Write tests/data/ds_dszero.json: what DeepSpeed 0.19.8 does with scripts/dszero_cases.py's
cases: DeepSpeedFP16Config's accepted and refused values, the zero_optimization.leaf_module
section and the leaf-marking calls (by name, by suffix, by class name), TiledLinear's tiles
and outputs (its weights given, so no random stream is shared), and one step at stages 1-2
with an unused parameter under ignore_unused_parameters (and contiguous_gradients false), and
the modules stage3_module_granularity_threshold makes leaves (with three steps' losses).
tests/compat/test_ds_unit_paths.py replays each case with dslaunch and compares.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_dszero_fixtures.py tests/data/ds_dszero.json
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_timing import free_port  # noqa: E402
import dszero_cases as cases  # noqa: E402


def fp16_case(kwargs):
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    try:
        cfg = DeepSpeedFP16Config(**kwargs)
    except Exception as exc:  # noqa: BLE001  the type is the record
        return {"outcome": "refused", "error": type(exc).__name__}
    return {"outcome": "accepted", "loss_scale": cfg.loss_scale, "loss_scale_window": cfg.loss_scale_window,
            "min_loss_scale": cfg.min_loss_scale}


def leaf_config_case(section):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = DeepSpeedZeroConfig() if section is None else DeepSpeedZeroConfig(leaf_module=section)
    lm = cfg.leaf_module
    return {"classes": list(lm.classes), "names": list(lm.names), "name_suffixes": list(lm.name_suffixes)}


def leaf_call_case(kind, arg):
    from deepspeed import utils

    return cases.leaf_call(utils, kind, arg, lambda m: getattr(m, "_z3_leaf", False))


def tiled_case(in_f, out_f, bias, in_splits, out_splits):
    from deepspeed.runtime.zero.tiling import TiledLinear

    torch.manual_seed(0)
    base = torch.nn.Linear(in_f, out_f, bias=bias)
    x = torch.randn(3, in_f)
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=base)
    out = tiled(x)
    out.pow(2).sum().backward()
    return {"weight": base.weight.tolist(), "bias": base.bias.tolist() if bias else None, "x": x.tolist(),
            "in_parts": list(tiled.in_parts), "out_parts": list(tiled.out_parts), "out": out.tolist(),
            "tile_bias": [[tile.bias is not None for tile in row] for row in tiled.linears],
            "tile_grads": [[tile.weight.grad.tolist() for tile in row] for row in tiled.linears]}


def tiled_bad(in_f, out_f, in_splits, out_splits):
    from deepspeed.runtime.zero.tiling import TiledLinear

    try:
        TiledLinear(in_f, out_f, in_splits=in_splits, out_splits=out_splits)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return "built"


def unused_case(zero):
    try:
        engine = cases.unused_engine(deepspeed, zero)
        engine.step()
        from deepspeed.utils import safe_get_full_fp32_param

        return {"outcome": "trained", "used_weight": safe_get_full_fp32_param(engine.module.used.weight).tolist()}
    except BaseException as exc:  # noqa: BLE001
        message = str(exc)
        return {"outcome": "refused", "error": type(exc).__name__,
                "names_key": "ignore_unused_parameters" in message}


def granularity_case(threshold):
    return cases.granularity_run(deepspeed, threshold, lambda m: getattr(m, "_z3_leaf", False))


def main():
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    out = {"deepspeed": deepspeed.__version__,
           "fp16": {name: fp16_case(kw) for name, kw in cases.FP16_CASES.items()},
           "leaf_config": {name: leaf_config_case(s) for name, s in cases.LEAF_CONFIG_CASES.items()},
           "leaf_calls": {name: leaf_call_case(*c) for name, c in cases.LEAF_CALL_CASES.items()},
           "tiled": {name: tiled_case(*c) for name, c in cases.TILED_CASES.items()},
           "tiled_bad": {name: tiled_bad(*c) for name, c in cases.TILED_BAD.items()},
           "unused": {name: unused_case(z) for name, z in cases.UNUSED_CASES.items()},
           "granularity": {str(t): granularity_case(t) for t in cases.GRANULARITY_THRESHOLDS}}
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
