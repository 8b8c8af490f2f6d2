"""DeepSpeed's tensor-fragment calls (deepspeed.utils.safe_get_full_fp32_param and friends)
through the compatibility package, at every ZeRO stage, on 2 ranks.

One multi-process body runs scripts/make_ds_fragment_fixtures.py's `exercise` (two AdamW
steps, a third backward, reads in the gradient window, three writes, a step, reads) for
every case and checks each value against two references:
- a one-process run written out by hand (the whole batch, fp32 masters, torch's AdamW,
  the same writes), for every case;
- what real DeepSpeed 0.19.8 returned for the same run (tests/data/ds_fragments/, made by
  the script), for the cases DeepSpeed runs on the CPU.
The same body checks the edges: the module's low-precision copy follows a written master
at once, gradients outside the window, an unknown state key, local calls below stage 3,
frozen parameters, a deep copy of the model, gradient accumulation.

Cases beyond DeepSpeed's (OURS_ONLY: what DeepSpeed returns None for, or cannot run on the
CPU): stage 0 in fp32, fp16 (its gradients carry the loss scale), NVMe and bf16 offload,
2 micro-batches a step.

Tolerances: fp32 1e-5 (summation order); bf16/fp16 2e-2 (the module computes in 16 bits on
half batches here, on the whole batch in the reference; DeepSpeed accumulates bf16
gradients in bf16, we in fp32).
"""
import copy
import os

import pytest
import torch

from dist_harness import run_function
from script_modules import load_script
import repo_paths

ROOT = str(repo_paths.ROOT)
FIXTURE = os.path.join(ROOT, "tests", "data", "ds_fragments", "fragments.pt")
fx = load_script("make_ds_fragment_fixtures")

# DeepSpeed's cases, and what only dslaunch answers (stage 0 in fp32) or DeepSpeed cannot check here
OURS_ONLY = {"s0_fp32": (0, "fp32", False), "s3_bf16_offload": (3, "bf16", True),
             "s1_fp16": (1, "fp16", False), "s3_fp16": (3, "fp16", False),
             "s2_fp32_nvme": (2, "fp32", "nvme"), "s3_fp32_nvme": (3, "fp32", "nvme"),
             # 2 micro-batches a step (stage 1 reduces at the boundary, 2 and 3 on every micro-step)
             "s1_fp32_gas2": (1, "fp32", False, 2), "s2_bf16_gas2": (2, "bf16", False, 2),
             "s3_fp32_gas2": (3, "fp32", False, 2),
             # stage 3 keeping the biases (8 and 3 elements) whole on every rank
             "s3_bf16_persist": (3, "bf16", False, 1, 8)}
CASES = {**fx.CASES, **OURS_ONLY}
KINDS = ("fp32", "exp_avg", "exp_avg_sq", "grad", "after")


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == "fp32" else dict(atol=2e-2, rtol=2e-2)


def reference(stage, dtype, offload, gas=1, persist=0):
    """The same run in one process: the whole batch each step, fp32 masters, torch AdamW."""
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    scale = fx.LOSS_SCALE.get(dtype, 1.0)  # what the gradients read in the window carry
    model = fx.make_model().to(tdtype)
    named = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in named.items()}
    hp = fx.config(stage, dtype, offload)["optimizer"]["params"]
    opt = torch.optim.AdamW(list(masters.values()), lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"])

    def backward(step):
        for micro in range(step * gas, step * gas + gas):
            xs, ys = zip(*(fx.batch(micro, r, tdtype) for r in range(fx.WORLD)))
            loss = (model(torch.cat(xs)).float() - torch.cat(ys)).pow(2).mean()
            (loss / gas).backward()
        for n, p in named.items():
            masters[n].grad = p.grad.float()
            p.grad = None

    def step():
        norm = float(torch.sqrt(sum((m.grad.float() ** 2).sum() for m in masters.values())))
        for m in masters.values():  # DeepSpeed's clipping: by clip / (norm + 1e-6) when the norm exceeds clip
            m.grad.mul_(min(1.0, fx.CLIP / (norm + 1e-6)))
        opt.step()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(masters[n])

    for s in range(2):
        backward(s)
        step()
    backward(2)
    out = {"fp32": {n: m.detach().clone() for n, m in masters.items()},
           "exp_avg": {n: opt.state[m]["exp_avg"].clone() for n, m in masters.items()},
           "exp_avg_sq": {n: opt.state[m]["exp_avg_sq"].clone() for n, m in masters.items()},
           "grad": {n: m.grad * scale for n, m in masters.items()}}
    for name, what, factor in fx.EDITS:
        target = {"fp32": masters[name], "grad": masters[name].grad}.get(what)
        if target is None:
            target = opt.state[masters[name]][what]
        target.mul_(factor)
    step()
    out["after"] = {n: m.detach().clone() for n, m in masters.items()}
    return out


def edges(deepspeed, stage, rank, persist=0):
    """The edges of the API at one stage (bf16; stage 3 keeping parameters of at most `persist`
    elements whole); returns a list of what went wrong."""
    from deepspeed import utils as du

    problems = []
    model = fx.make_model()
    model.inp.bias.requires_grad_(False)  # frozen: not stepped, so no master
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=fx.config(stage, "bf16", False, gas=2, persist=persist))[0]
    named = dict(engine.module.named_parameters())
    # odd: 3 elements, padded over 2 ranks at stage 3 (or kept whole there with persist=3)
    w, odd = named["inp.weight"], named["out.bias"]

    def raises(fn, words):
        try:
            fn()
        except ValueError as exc:
            if words not in str(exc):
                problems.append(f"stage {stage}: message {exc!r} lacks {words!r}")
            return
        problems.append(f"stage {stage}: {fn} did not raise")

    raises(lambda: du.safe_get_full_grad(w), "only available between")  # before any backward
    raises(lambda: du.safe_get_full_optimizer_state(w, "exp_avg"), "nothing yet")  # before the first step
    x, y = fx.batch(0, rank, torch.bfloat16)
    engine.backward((engine(x).float() - y).pow(2).mean())
    raises(lambda: du.safe_get_full_grad(w), "only available between")  # not the boundary micro-step
    engine.step()  # not the boundary: nothing happens
    engine.backward((engine(x).float() - y).pow(2).mean())
    frozen = named["inp.bias"]
    if du.safe_get_full_fp32_param(frozen) is not None or du.safe_get_full_grad(frozen) is not None:
        problems.append(f"stage {stage}: a frozen parameter answered")
    grad = du.safe_get_full_grad(w)
    try:  # a second backward now would be lost: refused
        engine.backward((engine(x).float() - y).pow(2).mean())
        problems.append(f"stage {stage}: a backward after the gradients were read was accepted")
    except ValueError:
        pass
    engine.step()
    raises(lambda: du.safe_get_full_grad(w), "only available between")  # after the step
    raises(lambda: du.safe_get_full_optimizer_state(w, "momentum"), "'momentum' not found")
    raises(lambda: du.safe_set_full_fp32_param(w, torch.zeros(3)), "has 3 elements")
    if stage < 3:
        raises(lambda: du.safe_get_local_fp32_param(w), "stage 3 parameters only")
        # a copy of the model (TRL's reference model) is no engine's: its parameters answer None
        if du.safe_get_full_fp32_param(copy.deepcopy(engine.module).inp.weight) is not None:
            problems.append(f"stage {stage}: a deep copy of a parameter still reaches the engine")
    for p, shape in ((w, (8, 5)), (odd, (3,))):
        new = torch.linspace(-1, 1, 8 * 5 if p is w else 3).view(shape) / 3
        du.safe_set_full_fp32_param(p, new)  # the module's bf16 copy follows at once
        with deepspeed.zero.GatheredParameters([p]):
            if not torch.equal(p.detach().float().cpu(), new.to(torch.bfloat16).float()):
                problems.append(f"stage {stage}: the module copy did not take the written master {shape}")
        if not torch.equal(du.safe_get_full_fp32_param(p), new):
            problems.append(f"stage {stage}: the master did not take the written value {shape}")
    if grad is None or grad.dtype != torch.float32 or tuple(grad.shape) != (8, 5):
        problems.append(f"stage {stage}: the gradient is not a whole fp32 tensor: {grad}")
    return problems


# DeepSpeed 0.19.8's parameter names (deepspeed/utils/tensor_fragment.py): scripts pass them by keyword too
SIGNATURES = {
    "safe_get_full_fp32_param": ["param"], "safe_set_full_fp32_param": ["param", "value"],
    "safe_get_full_optimizer_state": ["param", "optim_state_key"],
    "safe_set_full_optimizer_state": ["param", "value", "optim_state_key"],
    "safe_get_full_grad": ["param"], "safe_set_full_grad": ["param", "value"],
    "safe_get_local_fp32_param": ["param"], "safe_set_local_fp32_param": ["param", "value"],
    "safe_get_local_optimizer_state": ["param", "optim_state_key"],
    "safe_set_local_optimizer_state": ["param", "value", "optim_state_key"],
    "safe_get_local_grad": ["param"], "safe_set_local_grad": ["param", "value"],
    "safe_update_full_grad_vectorized": ["param_list", "update_func"],
}


def names_problems():
    import inspect

    import deepspeed.utils as du
    import deepspeed.utils.tensor_fragment as tf
    import dslaunch.runtime as runtime  # a script whose `import deepspeed` became dslaunch.runtime

    problems = []
    for name, params in SIGNATURES.items():
        if name not in du.__all__ or not getattr(tf, name, None) is getattr(runtime.utils, name, None) is \
                getattr(du, name):
            problems.append(f"{name}: not exported from deepspeed.utils, deepspeed.utils.tensor_fragment and "
                            f"dslaunch.runtime.utils")
        elif list(inspect.signature(getattr(du, name)).parameters) != params:
            problems.append(f"{name}: parameters {list(inspect.signature(getattr(du, name)).parameters)} != {params}")
    return problems


def body():
    import deepspeed
    import torch.distributed as dist

    rank = dist.get_rank()
    results = {name: fx.exercise(deepspeed, *case[:3], rank, *case[3:]) for name, case in CASES.items()}
    problems = names_problems() + [p for stage, persist in ((0, 0), (1, 0), (2, 0), (3, 0), (3, 3))
                                   for p in edges(deepspeed, stage, rank, persist)]
    return {"results": results, "problems": problems}


@pytest.fixture(scope="module")
def runs(deepspeed_compat):
    return run_function(body, nprocs=2, env=deepspeed_compat.env(), timeout=300)


def test_edges(runs):
    for r, run in enumerate(runs):
        assert run["problems"] == [], f"rank {r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_one_process(runs, name):
    dtype = CASES[name][1]
    ref = reference(*CASES[name])
    for run in runs:  # every rank reads the same whole values
        got = run["results"][name]
        for kind in KINDS:
            for pname, want in ref[kind].items():
                torch.testing.assert_close(got[kind][pname], want, **tol(dtype), msg=lambda m: f"{kind} {pname}: {m}")


@pytest.mark.parametrize("name", sorted(fx.CASES))
def test_against_deepspeed(runs, name):
    ds = torch.load(FIXTURE, weights_only=True)["cases"][name]
    dtype = CASES[name][1]
    got = runs[0]["results"][name]
    compared = 0
    # Under CPU offload DeepSpeed clips with the norm it took during backward, before
    # safe_set_full_grad wrote the gradient (without offload it takes the written one, as we
    # always do): its step after the write differs there, so only the reads are compared.
    kinds = [k for k in KINDS if not (k == "after" and CASES[name][2])]
    for kind in kinds:
        for pname, want in ds[kind].items():
            if want is None:
                continue
            torch.testing.assert_close(got[kind][pname], want, **tol(dtype), msg=lambda m: f"{kind} {pname}: {m}")
            compared += 1
    if CASES[name][0] == 3:  # every rank's own chunks (the padding past the parameter's end is
        # zero here, uninitialised memory in DeepSpeed: not compared)
        for r, run in enumerate(runs):
            for pname, chunks in ds["local"][r].items():
                numel = got["fp32"][pname].numel()
                for k, want in chunks.items():
                    mine = run["results"][name]["local"][pname][k]
                    assert mine.shape == want.shape, (r, pname, k)
                    real = max(0, min(want.numel(), numel - r * want.numel()))
                    torch.testing.assert_close(mine[:real], want[:real], **tol(dtype),
                                               msg=lambda m: f"rank {r} local {k} {pname}: {m}")
                    assert not mine[real:].any(), f"rank {r} local {k} {pname}: padding is not zero"
    assert compared >= len(ds["grad"]), f"DeepSpeed answered only {compared} reads"
