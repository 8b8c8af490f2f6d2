"""Write tests/data/ds_lr_schedules.json: what DeepSpeed's own LR schedules give for the cases
tests/runtime/train/test_lr_schedules_ds.py holds dslaunch's against (OneCycle's stair counts, decay and
per-group bounds; WarmupLR's per-group default maximum; a tensor lr filled in place).

Run it with a DeepSpeed install, in its own environment (it is never a dependency here):

    /path/to/ds-venv/bin/python scripts/make_ds_lr_fixture.py tests/data/ds_lr_schedules.json
"""
import json
import sys

import deepspeed
import torch
from deepspeed.runtime.lr_schedules import OneCycle, WarmupCosineLR, WarmupLR

sys.path.insert(0, __import__("os").path.dirname(__file__))
from ds_lr_cases import ONE_CYCLE_CASES, STEPS  # noqa: E402  the cases, shared with the test


def two_groups():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    return torch.optim.Adam([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}], betas=(0.9, 0.99))


def lrs(opt):
    return [float(g["lr"]) for g in opt.param_groups]


def main():
    out = {"deepspeed": deepspeed.__version__}
    for name, kwargs in ONE_CYCLE_CASES.items():
        opt = two_groups()
        s = OneCycle(opt, **kwargs)
        seen = {"lrs": [lrs(opt)], "moms": []}
        for _ in range(STEPS):
            s.step()
            seen["lrs"].append(lrs(opt))
            seen["moms"].append([m[0] for m in s.get_mom()])
        out[name] = seen
    opt = two_groups()
    w = WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    out["warmup_inherit"] = [lrs(opt)] + [(w.step(), lrs(opt))[1] for _ in range(5)]
    p = torch.nn.Parameter(torch.zeros(1))
    lr = torch.tensor(0.1, dtype=torch.float64)
    opt = torch.optim.SGD([p], lr=lr)
    c = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=4)
    out["cosine_tensor"] = [float(lr)] + [(c.step(), float(lr))[1] for _ in range(6)]
    with open(sys.argv[1], "w") as fh:  # DeepSpeed logs to stdout
        json.dump(out, fh, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main()
