"""A ZeRO-3 engine's optimizer answers DeepSpeed's stage-3 optimizer: isinstance
DeepSpeedZeroOptimizer_Stage3, and _get_norm_groups() gives each param group's gradient norm
over the data-parallel group, as it stands after backward (loss-scaled under fp16). Its
test_zero_grad_clip reads it before and after clamping the local gradients. Reference: one
process, plain torch, the whole batch."""
import copy

import torch

from dist_harness import run_function


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _groups(model):
    return [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.05}]


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def body(loss_scale):
    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = _model()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    if loss_scale:
        config["fp16"] = {"enabled": True, "loss_scale": loss_scale}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=_groups(model), config=config)
    x, y = _batch()
    mine = slice(2 * rank, 2 * rank + 2)
    dtype = torch.float16 if loss_scale else torch.float32
    engine.backward((engine(x[mine].to(dtype)).float() - y[mine]).square().mean())
    norms = [float(n) for n in optimizer._get_norm_groups()]
    engine.step()
    return {"stage3": isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3), "norms": norms, "world": world}


def _reference():
    model = _model()
    x, y = _batch()
    # the data-parallel mean: each rank's mean-squared loss over its half, averaged over 2 ranks
    loss = sum((model(x[i:i + 2]) - y[i:i + 2]).square().mean() for i in (0, 2)) / 2
    loss.backward()
    return [torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in g])).item()
            for g in (list(model[0].parameters()), list(model[2].parameters()))]


def test_norm_groups_are_each_groups_norm_over_the_ranks():
    expected = _reference()
    for out in run_function(body, nprocs=2, kwargs={"loss_scale": 0}, timeout=120):
        assert out["stage3"] and len(out["norms"]) == 2
        for got, want in zip(out["norms"], expected):
            assert abs(got - want) <= 1e-5 * max(1.0, want), (out["norms"], expected)


def test_norm_groups_are_loss_scaled_under_fp16():
    expected = _reference()
    for out in run_function(body, nprocs=2, kwargs={"loss_scale": 128}, timeout=120):
        for got, want in zip(out["norms"], expected):
            assert abs(got / 128 - want) <= 2e-2 * max(1.0, want), (out["norms"], expected)
