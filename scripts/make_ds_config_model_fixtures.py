"""Write tests/data/ds_config_model.json: what DeepSpeed 0.19.8's deepspeed.runtime.config_utils
does with each case of scripts/config_model_cases.py (config models built on DeepSpeedConfigModel
with deprecated, aliased, nested and typed fields; get_config_default; pp_int;
ScientificNotationEncoder; DeepSpeedConfigObject; the get_*_param helpers; the duplicate-key
reader). tests/runtime/core/test_config_model_base.py replays the cases on dslaunch's module.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_config_model_fixtures.py \
        tests/data/ds_config_model.json
"""
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.runtime import config_utils  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from config_model_cases import run_all  # noqa: E402  the cases, shared with the test


def main():
    out = {"deepspeed": deepspeed.__version__, "cases": run_all(config_utils)}
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
