"""Make tests/data/ds_cpu_optim.pt: what real DeepSpeed's CPU optimizers compute on
bf16/fp16 parameters, with fp32 or low-precision moments, through step_subgroup /
rollback_subgroup, and on sparse gradients.

    /work/ds-venv/bin/python scripts/make_ds_cpu_optim_fixtures.py [--out tests/data/ds_cpu_optim.pt]

Run it with a Python that has DeepSpeed 0.19.8 (its CPU ops build or load from torch's
extension cache); tests/kernels/test_deepspeed_cpu_optimizers.py replays every case through
dslaunch's `deepspeed.ops` classes without DeepSpeed. A case is the optimizer's class
name, its keyword arguments, the starting parameter and one gradient per step (dense, or
the (indices, values) of a sparse one), the calls ("step", "step_subgroup",
"rollback_subgroup") and what DeepSpeed left: the parameter and every state tensor.
"""
from __future__ import annotations

import argparse
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SIZE, STEPS = 37, 4  # 37: a SIMD tail in every instruction set


def dense_case(cls, kwargs, dtype, calls=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(SIZE, generator=g).to(dtype)
    grads = [torch.randn(SIZE, generator=g).to(dtype) for _ in range(STEPS)]
    return dict(cls=cls, kwargs=kwargs, param=p0, grads=grads, calls=calls or ["step"] * STEPS)


def sparse_case(seed=0):
    g = torch.Generator().manual_seed(seed)
    p0 = torch.randn(SIZE, generator=g)
    grads = []
    for _ in range(STEPS):
        idx = torch.randperm(SIZE, generator=g)[:9].sort().values
        grads.append((idx.unsqueeze(0), torch.randn(9, generator=g)))
    return dict(cls="DeepSpeedCPUAdagrad", kwargs={"lr": 0.05}, param=p0, grads=grads, calls=["step"] * STEPS)


CASES = {
    "adamw_bf16": dense_case("DeepSpeedCPUAdam", {"weight_decay": 0.01}, torch.bfloat16),
    "adamw_bf16_bf16_states": dense_case("DeepSpeedCPUAdam", {"weight_decay": 0.01, "fp32_optimizer_states": False},
                                         torch.bfloat16),
    "adam_l2_fp16": dense_case("DeepSpeedCPUAdam", {"weight_decay": 0.01, "adamw_mode": False}, torch.float16),
    "adam_no_bias_correction_fp16_states": dense_case(
        "DeepSpeedCPUAdam", {"bias_correction": False, "fp32_optimizer_states": False}, torch.float16),
    # sub-groups: two interleaved states on one parameter; DeepSpeed's rollback undoes fp32 tensors
    "subgroups_bf16": dense_case("DeepSpeedCPUAdam", {}, torch.bfloat16,
                                 ["step_subgroup:0", "step_subgroup:1", "step_subgroup:0", "step_subgroup:1"]),
    "rollback_fp32": dense_case("DeepSpeedCPUAdam", {"weight_decay": 0.01}, torch.float32,
                                ["step_subgroup:0", "step_subgroup:0", "step_subgroup:0", "rollback_subgroup:0"]),
    "lion_bf16": dense_case("DeepSpeedCPULion", {"lr": 0.01, "weight_decay": 0.1}, torch.bfloat16),
    "lion_fp16_fp16_states": dense_case("DeepSpeedCPULion", {"lr": 0.01, "fp32_optimizer_states": False},
                                        torch.float16),
    "adagrad_bf16": dense_case("DeepSpeedCPUAdagrad", {"lr": 0.05, "weight_decay": 0.01}, torch.bfloat16),
    "adagrad_sparse": sparse_case(),
}


def grad_of(case, i):
    g = case["grads"][i]
    if isinstance(g, tuple):
        return torch.sparse_coo_tensor(g[0], g[1], (SIZE,), check_invariants=True).coalesce()
    return g.clone()


def run(case, classes):
    """Replay a case; returns the parameter and the state tensors (by key, then state name)."""
    p = torch.nn.Parameter(case["param"].clone())
    opt = classes[case["cls"]]([p], **case["kwargs"])
    for i, call in enumerate(case["calls"]):
        name, _, sub = call.partition(":")
        if name != "rollback_subgroup":  # a rollback undoes the step before it with that step's gradient
            p.grad = grad_of(case, i)
        getattr(opt, name)(*([int(sub)] if sub else []))
    states = {}
    for key, st in opt.state.items():
        states[key if isinstance(key, int) else "param"] = {
            k: (int(v) if k == "step" else v.clone()) for k, v in st.items() if k == "step" or k in KEPT}
    return p.detach().clone(), states


KEPT = ("exp_avg", "exp_avg_sq", "sum")  # DeepSpeed's Lion keeps an unused exp_avg_sq too: compared where ours has it


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(HERE, "..", "tests", "data", "ds_cpu_optim.pt"))
    args = ap.parse_args()
    import deepspeed
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion

    classes = {"DeepSpeedCPUAdam": DeepSpeedCPUAdam, "DeepSpeedCPULion": DeepSpeedCPULion,
               "DeepSpeedCPUAdagrad": DeepSpeedCPUAdagrad}
    out = {"deepspeed": deepspeed.__version__, "cases": {}}
    for name, case in CASES.items():
        param, states = run(case, classes)
        out["cases"][name] = dict(case, expected_param=param, expected_states=states)
        print(f"{name}: {param.dtype}, states {sorted(states)}")
    torch.save(out, args.out)
    print(f"wrote {os.path.normpath(args.out)}")


if __name__ == "__main__":
    main()
