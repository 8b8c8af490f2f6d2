"""Stage 0 through the public API on real gloo processes.

One 2-rank run and one 1-rank run (the reference, same global batch) each train the same
tiny model under four configs (gradient accumulation 1 and 4, with and without
clipping); losses and final weights must match to 1e-5. The 2-rank run also counts
all-reduce calls per micro-step (none off the boundary), trains fp16/bf16 briefly, and
writes a checkpoint that a second, fresh 2-rank run resumes from: its losses must equal
the uninterrupted run's exactly.
"""
import math

import pytest

from dist_harness import run_function

GLOBAL_BATCH = 16
DIM = 6
CONFIGS = [dict(gas=1, clip=0.0), dict(gas=4, clip=0.0), dict(gas=1, clip=0.05), dict(gas=4, clip=0.05)]


def _model(seed):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 1))


def _batch(step):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def _engine(gas, clip, world, seed=0, precision=None, extra=None):
    import torch

    import dslaunch.runtime as deepspeed

    cfg = {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": gas, "steps_per_print": 1000,
           "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 0.01,
                                                        "warmup_type": "linear"}},
           # tiny buckets: several all-reduces per step, launched from backward hooks
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 100, "overlap_comm": True}}
    if precision:
        cfg[precision] = {"enabled": True}
        if precision == "fp16":
            cfg["fp16"]["initial_scale_power"] = 8
    cfg.update(extra or {})
    model = _model(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert engine.world_size == world
    return engine


def _train(engine, steps, first_step=0, fixed_batch=False):
    import torch

    rank, world = engine.global_rank, engine.world_size
    mb, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first_step, first_step + steps):
        x, y = _batch(0 if fixed_batch else step)
        total = 0.0
        for i in range(gas):
            lo = (i * world + rank) * mb
            xb, yb = x[lo:lo + mb].to(engine.compute_dtype), y[lo:lo + mb].to(engine.compute_dtype)
            loss = torch.nn.functional.mse_loss(engine(xb).float(), yb.float())
            engine.backward(loss)
            engine.step()
            total += float(loss)
        losses.append(total / gas)
    return losses


def _weights(engine):
    return [p.detach().float().clone() for p in engine.module.parameters()]


def parity_body(ckpt_dir=None):
    import torch
    import torch.distributed as dist

    out = {}
    for cfg in CONFIGS:
        engine = _engine(cfg["gas"], cfg["clip"], dist.get_world_size())
        losses = _train(engine, 6)
        out[(cfg["gas"], cfg["clip"])] = (losses, _weights(engine), engine.get_lr())
        engine.destroy()
    if ckpt_dir is None:
        return out

    # Communication only on boundary micro-steps.
    calls = []
    real = dist.all_reduce

    def counting(*a, **k):
        # graph task id != -1: called from a backward hook, i.e. overlapping backward
        calls.append((engine.micro_steps, torch._C._current_graph_task_id() != -1))
        return real(*a, **k)

    from dslaunch.runtime.comm.shm import Segment

    real_shm = Segment.all_reduce  # a same-host group's big all-reduces run through shared memory

    def counting_shm(*a, **k):
        calls.append((engine.micro_steps, torch._C._current_graph_task_id() != -1))
        return real_shm(*a, **k)

    engine = _engine(4, 0.0, dist.get_world_size())
    dist.all_reduce, Segment.all_reduce = counting, counting_shm
    try:
        _train(engine, 2)
    finally:
        dist.all_reduce, Segment.all_reduce = real, real_shm
    out["allreduce_micro_steps"] = sorted({m for m, _ in calls})
    out["allreduce_in_backward"] = [inside for _, inside in calls]
    out["n_buckets"] = len(engine.strategy.buckets)
    engine.destroy()

    # Mixed precision: finite, falling loss and identical replicas.
    for precision in ("fp16", "bf16"):
        engine = _engine(1, 1.0, dist.get_world_size(), precision=precision)
        losses = _train(engine, 8, fixed_batch=True)
        w = torch.cat([p.flatten() for p in _weights(engine)])
        gathered = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, w)
        out[precision] = (losses, all(torch.equal(gathered[0], g) for g in gathered), engine.skipped_steps,
                          engine.loss_scale(), engine.module[0].weight.dtype)
        engine.destroy()

    # Resume, part 1: an uninterrupted 6 steps, and a run that saves after 3.
    engine = _engine(2, 0.05, dist.get_world_size())
    out["uninterrupted"] = _train(engine, 6)
    engine.destroy()
    engine = _engine(2, 0.05, dist.get_world_size())
    _train(engine, 3)
    torch.manual_seed(1234 + dist.get_rank())  # RNG state must round-trip too
    out["rng_before"] = torch.rand(3)
    torch.manual_seed(1234 + dist.get_rank())
    engine.save_checkpoint(ckpt_dir, client_state={"epoch": 7})
    return out


def resume_body(ckpt_dir):
    import torch
    import torch.distributed as dist

    # A different initial model: everything must come from the checkpoint.
    engine = _engine(2, 0.05, dist.get_world_size(), seed=99)
    path, client = engine.load_checkpoint(ckpt_dir)
    rng = torch.rand(3)
    losses = _train(engine, 3, first_step=3)
    return {"path": path, "client": client, "steps": engine.global_steps, "losses": losses, "rng_after_load": rng}


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank_and_resume_exactly(tmp_path):
    import torch

    ckpt = str(tmp_path / "ckpt")
    two = run_function(parity_body, nprocs=2, kwargs={"ckpt_dir": ckpt}, timeout=200)
    one = run_function(parity_body, nprocs=1, timeout=120)[0]
    r0, r1 = two

    for cfg in CONFIGS:
        key = (cfg["gas"], cfg["clip"])
        ref_losses, ref_w, ref_lr = one[key]
        for rank_out in (r0, r1):
            losses, w, lr = rank_out[key]
            assert lr == ref_lr
            for a, b in zip(w, ref_w):
                assert torch.allclose(a, b, atol=1e-5, rtol=0), f"weights differ for {key}"
        # Rank losses are over half the batch each; their mean is the reference's loss.
        mean = [(a + b) / 2 for a, b in zip(r0[key][0], r1[key][0])]
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(mean, ref_losses)), key
        assert ref_losses[-1] < ref_losses[0]
    # Clipping changed the trajectory (so the clipped parity above is not vacuous).
    assert not torch.allclose(one[(1, 0.0)][1][0], one[(1, 0.05)][1][0])

    # No all-reduce on micro-steps 0-2 or 4-6 of gas=4; several buckets on micro-steps 3 and 7.
    assert r0["allreduce_micro_steps"] == [3, 7]
    assert r0["n_buckets"] > 1
    assert all(r0["allreduce_in_backward"]) and len(r0["allreduce_in_backward"]) == 2 * r0["n_buckets"]

    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        losses, same, skipped, scale, wdtype = r0[precision]
        assert all(math.isfinite(x) for x in losses) and same and wdtype == dtype
        assert losses[-1] < losses[0]
    assert r0["bf16"][2] == 0

    resumed = run_function(resume_body, nprocs=2, kwargs={"ckpt_dir": ckpt}, timeout=120)
    for rank, res in enumerate(resumed):
        assert res["client"] == {"epoch": 7} and res["steps"] == 6
        assert res["path"].endswith("global_step3")
        assert res["losses"] == two[rank]["uninterrupted"][3:]
        assert torch.equal(res["rng_after_load"], two[rank]["rng_before"])


def default_clipping_body():
    import torch

    import dslaunch.runtime as deepspeed

    out = {}
    for name, extra in (("default", {}), ("off", {"gradient_clipping": 0.0})):
        model = _model(0)
        cfg = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 1000,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **extra}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        for step in range(3):
            x, y = _batch(step)
            engine.backward(100.0 * torch.nn.functional.mse_loss(engine(x), y))  # gradient norm far above 1
            engine.step()
        out[name] = _weights(engine)
        engine.destroy()
    # The reference: torch's own loop, clipping the global norm to DeepSpeed's default 1.0.
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = _batch(step)
        (100.0 * torch.nn.functional.mse_loss(model(x), y)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    out["reference"] = [p.detach().float().clone() for p in model.parameters()]
    return out


def test_config_without_gradient_clipping_clips_at_deepspeeds_default_one():
    import torch

    out = run_function(default_clipping_body, nprocs=1, timeout=120)[0]
    for a, b in zip(out["default"], out["reference"]):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert not torch.allclose(out["off"][0], out["reference"][0], atol=1e-3)
