"""Two answers the differential test against DeepSpeed 0.19.8 found, through initialize():

- Under AutoTP (tensor_parallel.autotp_size, no mpu) DeepSpeed checks train_batch_size against
  every rank, tensor-parallel ones included: micro x accumulation x world size. A config
  written for it runs here with the same training; micro x accumulation x data-parallel ranks
  is refused as DeepSpeed refuses it.
- PyTorch-style loss.backward() without engine.scale(loss) under a static fp16 loss_scale:
  DeepSpeed trains it with unscaled gradients divided by the scale; refused here in one line
  with DeepSpeed's words and the reason (engine.scale(loss).backward() trains)."""
import pytest

from dist_harness import run_function
from hf_fixture import tiny_llama

VOCAB, SEQ, STEPS = 64, 8, 3


def tp_body(batch_key):
    """Two ranks, autotp_size 2 (one data-parallel rank): the losses, or the refusal."""
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime import ConfigError

    net = tiny_llama(VOCAB, attn="eager")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "tensor_parallel": {"autotp_size": 2}}
    if batch_key is not None:
        cfg["train_batch_size"] = batch_key
    try:
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    except ConfigError as exc:
        return {"error": str(exc)}
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"losses": losses, "train_batch_size": engine.train_batch_size(),
            "accumulation": engine.gradient_accumulation_steps()}


def test_autotp_train_batch_size_counts_every_rank_as_deepspeed():
    plain = run_function(tp_body, nprocs=2, kwargs=dict(batch_key=None), timeout=300)[0]
    assert plain["train_batch_size"] == 4  # 2 x 1 x world 2, DeepSpeed's figure
    counted = run_function(tp_body, nprocs=2, kwargs=dict(batch_key=4), timeout=300)[0]
    assert counted["losses"] == plain["losses"] and counted["accumulation"] == 1
    refused = run_function(tp_body, nprocs=2, kwargs=dict(batch_key=6), timeout=300)[0]
    assert "train_batch_size 6 != 2 x 1 x 2" in refused["error"] and "tensor-parallel ranks included" in \
        refused["error"] and "\n" not in refused["error"], refused


def scale_body(style):
    import torch

    import dslaunch.runtime as deepspeed

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}}, "fp16": {"enabled": True, "loss_scale": 128}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=cfg)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).half()
    loss = engine(x).float().pow(2).mean()
    try:
        if style == "torch":
            loss.backward()
        else:
            engine.scale(loss).backward()
    except RuntimeError as exc:
        return {"error": str(exc)}
    engine.step()
    return {"steps": engine.global_steps}


@pytest.mark.parametrize("style", ["torch", "scale"])
def test_static_fp16_scale_pytorch_style_backward(style):
    out = run_function(scale_body, nprocs=1, kwargs=dict(style=style), timeout=300)[0]
    if style == "scale":
        assert out == {"steps": 1}
        return
    msg = out["error"]
    assert msg.startswith("Loss scaling is required for this configuration") and "\n" not in msg
    assert "a static fp16 loss_scale needs it too" in msg
