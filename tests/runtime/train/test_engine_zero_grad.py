"""engine.zero_grad() inside a gradient-accumulation window, as DeepSpeed 0.19.8 does it:
it sets each parameter's .grad to None and nothing more. At ZeRO 0-1 the window's earlier
micro-batches live in .grad and are lost; at ZeRO 2-3 each backward has already reduced
them into the gradient partitions, which stay, so the step is the same as without the call.
(Found by scripts/diff_vs_deepspeed.py: `zero_grad=micro` cases at stage 2 trained other
numbers than DeepSpeed's.)"""
from dist_harness import run_function


def body():
    import torch

    import dslaunch.runtime as deepspeed

    out = {}
    for stage in (1, 2, 3):
        for zero_each_micro in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
            cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3, "steps_per_print": 1000,
                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_allow_untested_optimizer": True,
                   "zero_optimization": {"stage": stage}}
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            g = torch.Generator().manual_seed(1)
            for _ in range(2 * 3):
                if zero_each_micro:
                    engine.zero_grad()
                x, y = torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)
                engine.backward((engine(x) - y).pow(2).mean())
                engine.step()
            if stage == 3:
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    out[(stage, zero_each_micro)] = [p.detach().clone() for p in model.parameters()]
            else:
                out[(stage, zero_each_micro)] = [p.detach().clone() for p in model.parameters()]
    return out


def test_zero_grad_mid_window_drops_gradients_at_stage_1_and_keeps_reduced_ones_at_2_and_3():
    import torch

    out = run_function(body, nprocs=1, timeout=180)[0]
    same = {stage: all(torch.equal(a, b) for a, b in zip(out[(stage, False)], out[(stage, True)]))
            for stage in (1, 2, 3)}
    assert same == {1: False, 2: True, 3: True}
