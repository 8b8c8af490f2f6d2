"""Real-world configs load unchanged and train: the seeds' configs (all but `amp`, which
DeepSpeed removed), DeepSpeed's ZeRO tutorial configs and Hugging Face's published ZeRO-2 and
ZeRO-3 configs with their "auto" values filled in as the Trainer fills them
(tests/data/configs, SOURCES.md there)."""
import math

import pytest

from dist_harness import run_function
from real_configs import PRECISION, TRAINER, fill_auto, filled, published, runnable

from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.strict import ConfigError

# What a config that only sets zero_optimization (DeepSpeed's tutorial snippets) trains with.
MISSING = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
ONE_RANK = {"seed_000_gptneo_zero2_offload.json"}  # train_batch_size 1: written for one GPU
# fp16 configs start at a loss scale of 2**16, which the first steps overflow (skipped, as in
# DeepSpeed), and WarmupLR's first step has lr = warmup_min_lr = 0: 5 steps leave 2 that move.
STEPS = 5


def test_every_config_loads_unchanged():
    configs = runnable()
    assert len(configs) == 14
    for name, cfg in configs.items():
        DeepSpeedConfig.load(cfg)  # no error, nothing dropped
    for name, raw in published().items():
        if name in PRECISION:  # the published one still holds "auto": one line naming the key
            with pytest.raises(ConfigError, match=r'^config: [a-z_.0-9]+: "auto" is a placeholder the caller must'):
                DeepSpeedConfig.load(raw)
            assert filled()[name] == fill_auto(raw, {**TRAINER, **PRECISION[name]})  # only the autos differ
    cfg = DeepSpeedConfig.load(runnable()["hf_zero3_auto.json"])
    z = cfg.zero_optimization
    assert z.stage3_prefetch_bucket_size == 921 and z.stage3_gather_16bit_weights_on_model_save
    z = DeepSpeedConfig.load(runnable()["seed_004_gptlite_zero3.json"]).zero_optimization
    assert z.reduce_bucket_size == 500_000_000


def _train_each(names):
    import torch

    import dslaunch.runtime as deepspeed

    configs = runnable()
    out = {}
    for name in names:
        cfg = dict(configs[name])
        if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
            cfg.update(MISSING if "optimizer" not in cfg else {"train_micro_batch_size_per_gpu": 2})
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                    torch.nn.Tanh(), torch.nn.Linear(32, 1))
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        dtype = next(p for p in model.parameters()).dtype
        before = {n: v.float().clone() for n, v in engine.strategy.module_state_dict().items()}
        g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
        losses = []
        for _ in range(STEPS * engine.gradient_accumulation_steps()):
            x = torch.randn(engine.train_micro_batch_size_per_gpu(), 32, generator=g)
            loss = (engine(x.to(dtype)).float() - x[:, :1]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        after = engine.strategy.module_state_dict()
        changed = any(not torch.equal(before[n], v.float()) for n, v in after.items())
        out[name] = {"steps": engine.global_steps, "skipped": engine.skipped_steps, "changed": changed,
                     "finite": all(math.isfinite(v) for v in losses), "stage": engine.zero_optimization_stage(),
                     "dtype": str(dtype)}
        engine.destroy()
    return out


@pytest.mark.timeout(600)
def test_every_config_trains():
    names = sorted(runnable())
    two = run_function(_train_each, nprocs=2, kwargs={"names": [n for n in names if n not in ONE_RANK]},
                       timeout=500)[0]
    one = run_function(_train_each, nprocs=1, kwargs={"names": sorted(ONE_RANK)}, timeout=200)[0]
    results = {**two, **one}
    assert sorted(results) == names
    for name, r in results.items():
        assert r["steps"] == STEPS and r["finite"] and r["changed"] and r["skipped"] <= 2, (name, r)
    assert results["hf_zero3_auto.json"]["stage"] == 3 and results["hf_zero2_auto.json"]["dtype"] == "torch.float16"
    assert results["hf_tests_ds_config_zero2.json"]["dtype"] == "torch.bfloat16"
    assert results["seed_001_getting_started.json"]["stage"] == 1  # the legacy "zero_optimization": true
