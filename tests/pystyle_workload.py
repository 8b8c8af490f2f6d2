"""The training script of tests/runtime/train/test_pytorch_style_backward.py and
scripts/make_ds_pystyle_fixtures.py (which runs it under real DeepSpeed 0.19.8): the same
small MLP trained with `engine.backward(loss)` and with PyTorch-style backward. Written
against DeepSpeed's API only: `ds` is `deepspeed` or `dslaunch.runtime`, with a process group
already started.

A case (`CASES`, named by `case_name`) is a world size, a ZeRO stage, a dtype, the
accumulation steps, an offload, a backward style and a variant:

  style    engine     engine.backward(loss)
           tensor     loss.backward()
           scale      engine.scale(loss).backward()
           nonscalar  out.backward(grad), grad the loss's gradient with respect to the output
  variant  plain      loss = mse(engine(x), y)
           nested     the model returns (loss, output), the loss computed from that output
           two        two engines, one loss: mse(engine_a(x) + 0.5 * engine_b(x), y); both step
                      (engine style: engine_a.backward(loss))
           no_sync    no accumulation configured; each step backpropagates one micro-batch
                      inside engine.no_sync() and one outside it, then steps
           static     fp16 with a static loss scale of 128 (the others use a dynamic scale)

Each optimizer step sees 8 rows per micro-batch split over the ranks, the same rows whatever
the world size. A case yields the per-step losses (the mean over the step's micro-batches and
the ranks) or the error it stopped with.
"""
from __future__ import annotations

from typing import Dict, List

ROWS, STEPS = 8, 3
STYLES = ("engine", "tensor", "scale", "nonscalar")


def case_name(c: dict) -> str:
    off = {"none": "", "optimizer": "_offopt", "param": "_offparam"}[c["offload"]]
    variant = "" if c["variant"] == "plain" else f"_{c['variant']}"
    return f"w{c['world']}_s{c['stage']}_{c['dtype']}_g{c['gas']}{off}_{c['style']}{variant}"


def _case(world, stage, dtype, gas, style, variant="plain", offload="none") -> dict:
    return {"world": world, "stage": stage, "dtype": dtype, "gas": gas, "style": style, "variant": variant,
            "offload": offload}


def _matrix() -> List[dict]:
    out = []
    for stage in range(4):
        # one rank: the "nothing trains" rows (ZeRO-2/3 without accumulation)
        for gas in (1, 2):
            out += [_case(1, stage, "fp32", gas, s) for s in ("engine", "tensor")]
        # two ranks
        out += [_case(2, stage, "fp32", 1, s) for s in ("engine", "tensor", "nonscalar")]
        out += [_case(2, stage, "fp32", 2, s) for s in STYLES]
        out += [_case(2, stage, "fp32", 2, s, "nested") for s in ("engine", "tensor")]
        out += [_case(2, stage, "fp32", gas, s, "two") for gas in (1, 2) for s in ("engine", "tensor")]
        out += [_case(2, stage, "bf16", 2, s) for s in ("engine", "tensor", "nonscalar")]
        out += [_case(2, stage, "fp16", 2, s) for s in STYLES]
        out += [_case(2, stage, "fp32", 1, s, "no_sync") for s in ("engine", "tensor")]
    for stage in (1, 2, 3):
        out += [_case(2, stage, "fp32", 2, s, offload="optimizer") for s in ("engine", "tensor")]
    out += [_case(2, 3, "fp32", 2, s, offload="param") for s in ("engine", "tensor")]
    out += [_case(2, 2, "fp16", 2, s, "static") for s in ("engine", "tensor", "scale")]
    return out


CASES: Dict[str, dict] = {case_name(c): c for c in _matrix()}


def twin(name: str, **change) -> str:
    """The name of the case `name` with some fields changed."""
    return case_name(dict(CASES[name], **change))


def _differs() -> Dict[str, tuple]:
    out = {}
    for name, c in CASES.items():
        if c["variant"] == "nested" and c["style"] == "tensor" and c["stage"] in (1, 2):
            out[name] = (twin(name, style="engine"), "DeepSpeed divides the gradient by gas at the loss and again "
                                                     "at the output it was computed from")
        if c["variant"] == "static" and c["style"] == "tensor":
            out[name] = (twin(name, variant="plain"), "DeepSpeed trains an unscaled loss under a static fp16 scale")
        if c["stage"] == 0 and c["dtype"] == "fp16" and c["style"] == "engine":
            out[name] = (twin(name, stage=1), "DeepSpeed's stage-0 fp16 engine.backward leaves the loss unscaled "
                                              "and its FP16_UnfusedOptimizer divides the gradients by the scale")
        if c["stage"] == 0 and c["dtype"] == "bf16" and c["style"] == "engine":
            out[name] = (twin(name, stage=1), "DeepSpeed's stage-0 bf16 path (FP16_UnfusedOptimizer) disagrees with "
                                              "its own ZeRO-1 on this script")
    return out


# Where DeepSpeed 0.19.8's own answer is wrong: name -> (the case whose DeepSpeed answer this
# one must give instead, why). tests/runtime/train/test_pytorch_style_backward.py checks both halves.
DEEPSPEED_DIFFERS: Dict[str, tuple] = _differs()


def make_model(seed: int = 0, hidden: int = 16, nested: bool = False):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(6, hidden)
            self.out = torch.nn.Linear(hidden, 4)

        def forward(self, x, y=None):
            out = self.out(torch.tanh(self.inp(x)))
            if nested:  # a loss and the output it comes from, as a Hugging Face model returns them
                return (out.float() - y).pow(2).mean(), out
            return out

    torch.manual_seed(seed)
    return Net()


def config(case: dict) -> dict:
    gas = 1 if case["variant"] == "no_sync" else case["gas"]
    zero = {"stage": case["stage"]}
    if case["offload"] in ("optimizer", "param"):
        zero["offload_optimizer"] = {"device": "cpu"}
    if case["offload"] == "param":
        zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_batch_size": ROWS * gas, "train_micro_batch_size_per_gpu": ROWS // case["world"],
           "gradient_accumulation_steps": gas, "gradient_clipping": 1.0, "steps_per_print": 1000,
           # eps large enough that the size of the gradient shows in Adam's step; torch's AdamW,
           # or under offload each side's CPU Adam (DeepSpeedCPUAdam there)
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "eps": 0.01, "weight_decay": 0.0}},
           "zero_optimization": zero}
    if case["offload"] == "none":
        cfg["optimizer"]["params"]["torch_adam"] = True
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif case["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if case["variant"] == "static":
            cfg["fp16"]["loss_scale"] = 128
    return cfg


def batch(i: int, rank: int, world: int, dtype):
    import torch

    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g)
    n = ROWS // world
    return x[rank * n:(rank + 1) * n].to(dtype), y[rank * n:(rank + 1) * n]


def _mse(out, y):
    return (out.float() - y).pow(2).mean()


def _micro_step(engines, case: dict, x, y):
    """One forward and backward; the loss's value."""
    import torch

    style, main = case["style"], engines[0]
    if case["variant"] == "nested":
        loss, out = main(x, y)
    elif case["variant"] == "two":
        out = main(x).float() + 0.5 * engines[1](x).float()
        loss = _mse(out, y)
    else:
        out = main(x)
        loss = _mse(out, y)
    if style == "engine":
        main.backward(loss)
    elif style == "tensor":
        loss.backward()
    elif style == "scale":
        main.scale(loss).backward()
    else:  # the loss's gradient with respect to the output, given by hand
        with torch.no_grad():
            grad = (2.0 / out.numel()) * (out.float() - y)
        out.backward(grad.to(out.dtype))
    return float(loss.detach())


def run_case(ds, case: dict, rank: int, world: int) -> dict:
    """{"losses": [...]} or {"error": message, "types": the exception's class names}."""
    import torch
    import torch.distributed as dist

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[case["dtype"]]
    cfg = config(case)
    models = [make_model(0, 16, nested=case["variant"] == "nested")]
    if case["variant"] == "two":
        models.append(make_model(1, 8))
    engines = []
    try:
        for m in models:
            engines.append(ds.initialize(model=m, model_parameters=list(m.parameters()), config=cfg)[0])
        losses = []
        gas = cfg["gradient_accumulation_steps"]
        for step in range(STEPS):
            seen = []
            if case["variant"] == "no_sync":
                with engines[0].no_sync():
                    seen.append(_micro_step(engines, case, *batch(2 * step, rank, world, dtype)))
                seen.append(_micro_step(engines, case, *batch(2 * step + 1, rank, world, dtype)))
                engines[0].step()
            else:
                for micro in range(gas):
                    seen.append(_micro_step(engines, case, *batch(step * gas + micro, rank, world, dtype)))
                    for e in engines:
                        e.step()
            total = torch.tensor(sum(seen) / len(seen), dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(float(total) / world)
        return {"losses": losses}
    except Exception as exc:  # the case's answer is the error (every rank raises it alike)
        return {"error": str(exc).strip().splitlines()[0], "types": [c.__name__ for c in type(exc).__mro__]}
    finally:
        for e in engines:
            e.destroy()
