"""Write tests/data/ds_ckpt_reshape.json: what DeepSpeed 0.19.8's checkpoint-folder readers
answer for scripts/ckpt_reshape_cases.py's cases: model_3d_desc's reshape maps for every
(pp, tp, dp) up to 4 read at every smaller one, get_model_3d_descriptor on folders with and
without (and with bad) checkpoint_parallel_dimensions, ZeROCheckpoint's files and merged
state per rank, DeepSpeedCheckpoint on a Megatron-DeepSpeed folder (layer files, maps,
merged tensor slices), ds_to_universal._aggregate_autoep_zero12_metadata, and
runtime.engine._checkpoint_parallel_metadata. Refusals are recorded by their first line.
tests/runtime/train/checkpoint/test_ckpt_reshape_vs_deepspeed.py replays them with dslaunch.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python scripts/make_ds_ckpt_reshape_fixtures.py
"""
import json
import os
import sys
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(os.path.dirname(HERE), "tests", "data", "ds_ckpt_reshape.json")


def main() -> None:
    try:
        import deepspeed
        from deepspeed.checkpoint import DeepSpeedCheckpoint, ZeROCheckpoint, get_model_3d_descriptor, model_3d_desc
        from deepspeed.checkpoint.ds_to_universal import _aggregate_autoep_zero12_metadata
        from deepspeed.runtime.engine import _checkpoint_parallel_metadata
    except ImportError as exc:
        sys.exit(f"error: run this with a Python that has deepspeed installed ({exc})")
    sys.path.insert(0, HERE)
    import ckpt_reshape_cases

    ds = types.SimpleNamespace(model_3d_desc=model_3d_desc, get_model_3d_descriptor=get_model_3d_descriptor,
                               ZeROCheckpoint=ZeROCheckpoint, DeepSpeedCheckpoint=DeepSpeedCheckpoint,
                               aggregate_autoep=_aggregate_autoep_zero12_metadata,
                               parallel_metadata=_checkpoint_parallel_metadata)
    result = ckpt_reshape_cases.run(ds)
    with open(OUT, "w") as fh:
        json.dump({"deepspeed": deepspeed.__version__, "cases": result}, fh, indent=0, sort_keys=True)
    print(f"wrote {OUT}: " + ", ".join(f"{k} {len(v)}" for k, v in result.items()))


if __name__ == "__main__":
    main()
