"""AutoEP on one CUDA device (gpu-marked: skips without one): the swapped model of each family
computes the model's loss and gradients through torch._grouped_mm and through the per-expert
loop, in fp32 and bf16, and trains through deepspeed.initialize with autoep_size 1.

Tolerances: fp32 1e-5 on the loss (the grouped GEMM sums in another order than the model's
per-expert matmuls); bf16 2e-2 on the loss, 1/8 of the largest gradient entry on each gradient
(one bf16 rounding of the routed copies' outputs, and of the gradients through them, happens at
a different point)."""
from __future__ import annotations

import copy

import pytest
import torch
from script_modules import load_script

fx = load_script("make_ds_autoep_fixtures")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("transformers")


def _swap(model, section):
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.moe import autoep
    from dslaunch.runtime.moe.autoep.convert import swap

    cfg = DeepSpeedConfig.load({"train_batch_size": 2, "expert_parallel": dict({"enabled": True}, **section)})
    cfg = cfg.expert_parallel
    swap(model, autoep.detect(model, cfg), cfg, 1, 0, None)
    return model


def _loss_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "loop"])
def test_swapped_model_on_cuda_computes_the_model(name, dtype, grouped):
    from dslaunch.runtime.moe import autoep

    ref = fx.make_model(name).to("cuda", dtype)
    section = {"use_grouped_mm": grouped, **({"preset_model": fx.PRESET[name]} if name in fx.PRESET else {})}
    model = _swap(copy.deepcopy(ref), section)
    ids = torch.cat([fx.batch(0, 0), fx.batch(0, 1)]).cuda()
    loss, grads = _loss_grads(model, ids)
    ref_loss, ref_grads = _loss_grads(ref, ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - ref_loss.item()) <= tol, (loss.item(), ref_loss.item())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    back = autoep.hf_state_dict(model)
    for key, g in ref_grads.items():
        err = (back[key].float().cuda() - g).abs().max().item()
        bound = 1e-5 if dtype == torch.float32 else g.abs().max().item() / 8 + 1e-6
        assert err <= bound, (key, err, bound)


def test_initialize_trains_on_cuda_with_autoep():
    import dslaunch.runtime as deepspeed

    job = dict(model="deepseek_v3", world=1, gas=2, stage=2, ep=1)
    ref, _ = fx.train(deepspeed, dict(job, ep=None), 0, {"bf16": {"enabled": True}})
    got, engine = fx.train(deepspeed, job, 0, {"bf16": {"enabled": True}})
    assert next(engine.module.parameters()).device.type == "cuda"
    assert max(abs(a - b) for a, b in zip(got, ref)) <= 2e-2, (got, ref)
