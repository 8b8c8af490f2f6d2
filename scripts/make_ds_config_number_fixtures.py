"""Write tests/data/ds_config_numbers.json: what DeepSpeed 0.19.8 does with each config of
scripts/config_number_cases.py (NaN and Infinity, numbers as strings, negative or
out-of-range values, duplicate keys, deep nesting): refused (the exception's type and first
line) or trained (one step of a 4->2 linear layer: are the weights still finite, and the lr
the optimizer ended up with). tests/runtime/core/test_config_numbers.py holds dslaunch to refusing every
case, so it does at least as well as DeepSpeed on each.

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    DS_ACCELERATOR=cpu /path/to/ds-venv/bin/python scripts/make_ds_config_number_fixtures.py \
        tests/data/ds_config_numbers.json
"""
import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in (("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_timing import free_port  # noqa: E402  (scripts/: the port helper every script shares)
from config_number_cases import CASES  # noqa: E402  the cases, shared with the test


def run(text: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        fh.write(text)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=fh.name)
        loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        lr = engine.optimizer.param_groups[0]["lr"]
        return {"outcome": "trained", "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                "lr": lr if isinstance(lr, (int, float)) else repr(lr)}
    except BaseException as exc:  # noqa: BLE001  what DeepSpeed raises is the record
        first = (str(exc).splitlines() or [""])[0]
        return {"outcome": "refused", "error": f"{type(exc).__name__}: {first[:300]}"}
    finally:
        os.unlink(fh.name)


def main():
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    out = {"deepspeed": deepspeed.__version__, "cases": {name: run(text) for name, (text, _) in CASES.items()}}
    with open(sys.argv[1], "w") as fh:  # DeepSpeed logs to stdout
        json.dump(out, fh, indent=1, allow_nan=True)
        fh.write("\n")


if __name__ == "__main__":
    main()
