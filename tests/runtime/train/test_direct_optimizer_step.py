"""A script that steps the optimizer initialize() returned (`engine.backward(loss);
optimizer.step()`) where the strategy owns the step (runtime/train/direct_step.py).

Before, at ZeRO 1-3 that step() stepped masters whose .grad was None: nothing trained and
nothing said so. DeepSpeed 0.19.8's ZeRO optimizer steps there, exactly as engine.step()
would, but leaves the LR scheduler and the engine's step count where they are. The
reference is engine.step() on the same data, 2 ranks; the scheduler's and counters' part is
checked against DeepSpeed's answer (lr and global_steps unchanged)."""
import pytest
import torch

from dist_harness import run_function


def _train(stage, direct, bf16=False, scheduler=False):
    import dslaunch.runtime as deepspeed
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.5,
           "optimizer": {"type": "Adam", "params": {"lr": 0.05}}, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": bf16}}
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05,
                                                           "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    def weights():
        return [p.detach().float().clone() for p in engine.module.parameters()] if stage < 3 else \
            [deepspeed.utils.safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]

    initial = weights()
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    losses = []
    for _ in range(4):
        x = torch.randn(2, 4, generator=g).to(engine.module[0].weight.dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        losses.append(loss.item())
        if direct:
            optimizer.step()
        else:
            engine.step()
    return {"losses": losses, "initial": initial, "params": weights(), "lr": engine.get_lr()[0], "global_steps": engine.global_steps,
            "norm": getattr(optimizer, "_global_grad_norm", None)}


def direct_step_body():
    out = {}
    for name, kw in {"zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3),
                     "bf16 zero0": dict(stage=0, bf16=True)}.items():
        out[name] = (_train(direct=True, **kw), _train(direct=False, **kw))
    out["scheduled"] = _train(stage=2, direct=True, scheduler=True)
    return out


def refusal_body():
    import dslaunch.runtime as deepspeed

    model = torch.nn.Linear(4, 2)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
        "train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}})
    try:
        optimizer.step()
    except AssertionError as err:
        return str(err)
    return None


def test_the_returned_optimizers_step_is_the_engines_step_without_schedule_or_count():
    out = run_function(direct_step_body, nprocs=2, timeout=300)
    for rank in out:
        for name in ("zero1", "zero2", "zero3", "bf16 zero0"):
            direct, engine = rank[name]
            assert direct["losses"] == engine["losses"], name
            for a, b in zip(direct["params"], engine["params"]):
                assert torch.equal(a, b), name
            assert all(not torch.equal(a, b) for a, b in zip(direct["params"], direct["initial"])), name
            assert direct["global_steps"] == 0 and engine["global_steps"] == 4, name
            assert direct["norm"] == pytest.approx(engine["norm"]), name
        sched = rank["scheduled"]
        assert sched["lr"] == pytest.approx(0.01)  # DeepSpeed's ZeRO optimizer.step() leaves the scheduler alone
        assert sched["global_steps"] == 0


def test_a_direct_step_with_no_gradients_is_one_line():
    assert run_function(refusal_body, nprocs=1, timeout=120)[0] == (
        "engine.optimizer.step(): no gradients to step with; call it after engine.backward() on the "
        "gradient-accumulation boundary, or call engine.step()")
