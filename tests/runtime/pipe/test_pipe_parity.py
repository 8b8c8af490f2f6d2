"""Pipeline parallelism through the public API (deepspeed.pipe.PipelineModule +
initialize + train_batch): GPT-lite built by to_layers() (lambdas included) trains with
the per-step losses of the same layers trained without a pipeline, on the same global
batches, at fp32 and 1e-5. The reference is plain torch in the same process (AdamW, the
same WarmupLR, global-norm clipping), so nothing of the engine is on both sides.

One 2-rank job (pp=2) and one 4-rank job (pp=2 x dp=2) each run several configurations:
stage 0, ZeRO-1, ZeRO-2, a TiedLayerSpec embedding/head, activation_checkpoint_interval=1,
eval_batch, bf16 and fp16 (loss scaler), a sequence length that changes between batches, global-norm
clipping (the threshold binds) under WarmupLR, a data iterator that runs out mid-batch; the 4-rank
job also counts every collective per process group. Runs on NCCL too: set
DSLAUNCH_TEST_BACKEND=nccl on a machine with 2 (4) GPUs (see tests/dist_harness.py).
"""
import importlib.util
import os

import pytest
import torch

from dist_harness import run_function
import repo_paths

ROOT = str(repo_paths.ROOT)
EXAMPLE = os.path.join(ROOT, "scripts", "examples", "gptlite_pipeline.py")
TOL = 1e-5
STEPS = 3
MICRO = 2
VOCAB = 256


def gptlite():
    """The example's GPT-lite module, shrunk (2 blocks of width 16, 8 tokens)."""
    spec = importlib.util.spec_from_file_location("gptlite_pipeline_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.n_layer, mod.n_embd, mod.n_head, mod.block_size = 2, 16, 2, 8
    return mod


# -- a tied embedding / LM head model, built from specs ------------------------------------
class Embed(torch.nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, dim) * 0.1)

    def forward(self, idx):
        return torch.nn.functional.embedding(idx, self.weight)


class Mix(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def lm_head(embed, x):
    return x @ embed.weight.t()


def swap(logits):
    return torch.swapaxes(logits, 1, 2)


def tied_specs(dim=12):
    from dslaunch.runtime.pipe import LayerSpec, TiedLayerSpec

    return [TiedLayerSpec("embed", Embed, VOCAB, dim), LayerSpec(Mix, dim), LayerSpec(Mix, dim),
            LayerSpec(torch.nn.LayerNorm, dim), TiedLayerSpec("embed", Embed, VOCAB, dim, forward_fn=lm_head), swap]


def tied_reference(dim=12, base_seed=1234):
    """The same layers without a pipeline: built in order with PipelineModule's seed_layers
    seeds, the tied module once (at its first layer)."""
    built, mods = {}, []
    for idx, spec in enumerate(tied_specs(dim)):
        torch.manual_seed(base_seed + idx)
        key = getattr(spec, "key", None)
        if key is not None and key not in built:
            built[key] = spec.build()
        mods.append(built[key] if key is not None else spec.build() if hasattr(spec, "build") else None)
    emb, mix1, mix2, ln = mods[0], mods[1], mods[2], mods[3]
    params = torch.nn.ModuleList([emb, mix1, mix2, ln])
    return params, lambda idx: swap(lm_head(emb, ln(mix2(mix1(emb(idx))))))


# -- shared pieces ------------------------------------------------------------------------------
def config(gas, zero=0, clip=0.05, dtype="fp32", **extra):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
           "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99], "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.002, "warmup_max_lr": 0.02,
                                                        "warmup_num_steps": 3}},
           "zero_optimization": {"stage": zero, "reduce_bucket_size": 300, "allgather_bucket_size": 300}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 2, "hysteresis": 1}
    cfg.update(extra)
    return cfg


def global_batches(steps, dp, gas, seq=8, seed=7):
    """steps x (dp * gas) micro-batches of (tokens, next tokens); `seq` is the sequence length
    of every step, or a list of one per step."""
    g = torch.Generator().manual_seed(seed)
    seqs = seq if isinstance(seq, list) else [seq] * steps
    out = []
    for n in seqs:
        out.append([(torch.randint(0, VOCAB, (MICRO, n), generator=g), torch.randint(0, VOCAB, (MICRO, n),
                                                                                         generator=g))
                    for _ in range(dp * gas)])
    return out


def replica_iter(batches, dp_rank, gas):
    """This replica's share of every global batch, in order."""
    return iter([mb for step in batches for mb in step[dp_rank * gas:(dp_rank + 1) * gas]])


def train_reference(params, forward, batches, cfg, norms=None):
    """Plain torch: mean loss over a global batch's micro-batches, clip, AdamW, WarmupLR;
    `norms` collects each step's gradient norm before clipping."""
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.lr_schedules import build_scheduler

    c = cfg["optimizer"]["params"]
    opt = torch.optim.AdamW(params.parameters(), lr=c["lr"], betas=tuple(c["betas"]), weight_decay=c["weight_decay"])
    sched = build_scheduler(DeepSpeedConfig.load(cfg).scheduler, opt)
    losses = []
    for mbs in batches:
        total = 0.0
        for x, y in mbs:
            loss = torch.nn.functional.cross_entropy(forward(x), y) / len(mbs)
            loss.backward()
            total += float(loss)
        norm = torch.nn.utils.clip_grad_norm_(params.parameters(), cfg["gradient_clipping"])
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def gptlite_pair(mod):
    """A GPT-lite model for the pipeline and an identical copy (made first) for the reference."""
    import copy

    torch.manual_seed(0)
    model = mod.GPTlite()
    ref = copy.deepcopy(model)
    return model, ref


def pipeline_engine(layers, pp, cfg, **module_kwargs):
    import dslaunch.runtime as deepspeed

    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=pp, loss_fn=torch.nn.CrossEntropyLoss(),
                                        **module_kwargs)
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
    return engine


def run_gptlite(pp, dp, gas, cfg, steps=STEPS, seq=8, norms=None, **module_kwargs):
    """(pipeline losses, reference losses) for GPT-lite over the same global batches."""
    mod = gptlite()
    model, ref = gptlite_pair(mod)
    engine = pipeline_engine(model.to_layers(), pp, cfg, **module_kwargs)
    batches = global_batches(steps, dp, gas, seq=seq)
    it = replica_iter(batches, engine.grid.get_data_parallel_rank(), gas)
    losses = [float(engine.train_batch(it)) for _ in range(steps)]
    engine.destroy()
    return losses, train_reference(ref, ref, batches, cfg, norms)


# -- 2 ranks: pp=2 ------------------------------------------------------------------------------
def _pp2_worker():
    from dslaunch.runtime.pipe import PipelineError

    from collectives import CollectiveRecorder

    out = {}
    gas = 4
    norms = []
    out["fp32"] = run_gptlite(2, 1, gas, config(gas), norms=norms)
    out["norms"] = norms  # the clipping threshold binds: a per-stage norm would change the losses
    # the sequence length changes between batches (8, 6, 6, 8): the shapes are described once
    # per batch and stage boundary (one header), then the batch's activations follow
    rec = CollectiveRecorder().install()
    out["shapes"] = run_gptlite(2, 1, gas, config(gas), steps=4, seq=[8, 6, 6, 8])
    rec.uninstall()
    out["sends"] = sum(1 for name, _, _ in rec.records if name == "send")
    out["zero1"] = run_gptlite(2, 1, gas, config(gas, zero=1))
    out["ckpt_interval"] = run_gptlite(2, 1, gas, config(gas), activation_checkpoint_interval=1)

    params, forward = tied_reference()
    batches = global_batches(STEPS, 1, gas)
    engine = pipeline_engine(tied_specs(), 2, config(gas), seed_layers=True, partition_method="uniform")
    it = replica_iter(batches, 0, gas)
    tied = [float(engine.train_batch(it)) for _ in range(STEPS)]
    # the tied weight is the same on both stages after every step
    w = engine.module.tied_modules["embed"].weight.detach().clone()
    torch.distributed.all_reduce(w, op=torch.distributed.ReduceOp.MAX)
    tied_equal = torch.equal(w, engine.module.tied_modules["embed"].weight.detach())
    engine.destroy()
    out["tied"] = (tied, train_reference(params, forward, batches, config(gas)))
    out["tied_equal"] = tied_equal

    # eval_batch: the reference model's loss on the same micro-batches, on every rank
    mod = gptlite()
    model, ref = gptlite_pair(mod)
    engine = pipeline_engine(model.to_layers(), 2, config(gas))
    evals = global_batches(1, 1, gas, seed=11)[0]
    loss, logits = engine.eval_batch(iter(evals), return_logits=True)
    with torch.no_grad():
        ref_eval = sum(float(torch.nn.functional.cross_entropy(ref(x), y)) for x, y in evals) / gas
    out["eval"] = (float(loss), ref_eval, None if logits is None else list(logits.shape))

    # a data iterator that runs out in the middle of a batch: one clear error on both stages
    try:
        engine.train_batch(iter(evals[:2]))
        out["ran_out"] = "no error"
    except PipelineError as exc:
        out["ran_out"] = str(exc)
    out["after"] = float(engine.eval_batch(iter(evals)))  # the engine goes on after the error
    engine.destroy()

    # bf16 trains close to the fp32 reference; fp16 skips its overflowing first steps on every rank alike
    out["bf16"] = run_gptlite(2, 1, gas, config(gas, dtype="bf16"))
    mod = gptlite()
    model, _ = gptlite_pair(mod)
    engine = pipeline_engine(model.to_layers(), 2, config(gas, dtype="fp16"))
    it = replica_iter(global_batches(4, 1, gas), 0, gas)
    fp16 = [float(engine.train_batch(it)) for _ in range(4)]
    out["fp16"] = (fp16, engine.skipped_steps, engine.loss_scale(), engine.is_first_stage(), engine.is_last_stage())
    engine.destroy()
    return out


def check_pp2(results, tol):
    """The 2-stage job's results (shared with the NCCL run of test_pipe_gpu.py)."""
    for r in results:
        for key in ("fp32", "zero1", "ckpt_interval", "tied", "shapes"):
            got, ref = r[key]
            assert got == pytest.approx(ref, rel=tol, abs=tol), key
        loss, ref_eval, logits = r["eval"]
        assert loss == pytest.approx(ref_eval, rel=tol, abs=tol)
        assert r["ran_out"].startswith("pipeline: the data iterator ran out after 2 of the 4 micro-batches")
        assert r["after"] == loss
        assert r["tied_equal"]
        got, ref = r["bf16"]
        assert got == pytest.approx(ref, rel=3e-2, abs=3e-2)
    assert min(results[0]["norms"]) > config(4)["gradient_clipping"]
    # stage 0 sends 4 batches x (1 header + 4 activations), stage 1 the 4 x 4 gradients back
    assert [r["sends"] for r in results] == [4 * (1 + 4), 4 * 4]
    assert results[0]["eval"][2] is None and results[1]["eval"][2] == [MICRO, VOCAB, 8]  # logits: last stage
    # every rank returns the same loss; fp16 overflowed (scale 2^30) and skipped on both stages alike
    assert results[0]["fp32"][0] == results[1]["fp32"][0]
    f0, f1 = results[0]["fp16"], results[1]["fp16"]
    assert f0[:3] == f1[:3] and f0[1] >= 1 and f0[2] < 2.0 ** 30
    assert all(loss == loss and loss < 10 for loss in f0[0])
    assert f0[3:] == (True, False) and f1[3:] == (False, True)


@pytest.mark.timeout(400)
def test_pipeline_2_stages_matches_unpipelined_training():
    check_pp2(run_function(_pp2_worker, nprocs=2, timeout=380), TOL)


# -- 4 ranks: pp=2 x dp=2 -------------------------------------------------------------------------
def _pp2dp2_worker():
    import torch.distributed as dist

    from collectives import CollectiveRecorder

    rank = dist.get_rank()
    rec = CollectiveRecorder().install()
    out = {}
    gas = 2
    start = rec.mark()
    out["fp32"] = run_gptlite(2, 2, gas, config(gas))
    calls = rec.since(start)
    out["zero1"] = run_gptlite(2, 2, gas, config(gas, zero=1))
    out["zero2"] = run_gptlite(2, 2, gas, config(gas, zero=2))

    params, forward = tied_reference()
    batches = global_batches(STEPS, 2, gas)
    engine = pipeline_engine(tied_specs(), 2, config(gas, zero=1), seed_layers=True, partition_method="uniform")
    it = replica_iter(batches, engine.grid.get_data_parallel_rank(), gas)
    tied = [float(engine.train_batch(it)) for _ in range(STEPS)]
    engine.destroy()
    out["tied_zero1"] = (tied, train_reference(params, forward, batches, config(gas)))
    rec.uninstall()

    # where each of the fp32 run's collectives went (checked in the test)
    out["rank"] = rank
    out["calls"] = sorted({(name, ranks, peer) for name, ranks, peer in calls})
    return out


@pytest.mark.timeout(500)
def test_pipeline_2_stages_x_2_replicas_matches_and_keeps_collectives_in_their_groups():
    results = run_function(_pp2dp2_worker, nprocs=4, timeout=480)
    for r in results:
        for key in ("fp32", "zero1", "zero2", "tied_zero1"):
            got, ref = r[key]
            assert got == pytest.approx(ref, rel=TOL, abs=TOL), (r["rank"], key)
        rank = r["rank"]
        dp_pair = (0, 1) if rank < 2 else (2, 3)  # DeepSpeed's layout: (pipe, data), data innermost
        pipeline = (0, 2) if rank % 2 == 0 else (1, 3)
        peer = pipeline[1] if rank == pipeline[0] else pipeline[0]
        for name, ranks, p in r["calls"]:
            if name in ("send", "recv", "isend", "irecv"):
                assert p == peer, (rank, name, p)  # activations and gradients only to the neighbour stage
            elif name == "barrier":  # PipelineModule's, once every rank has made its groups
                assert ranks == (0, 1, 2, 3), (rank, name, ranks)
            else:
                assert ranks in (dp_pair, pipeline), (rank, name, ranks)
        names_by_group = {}
        for name, ranks, _ in r["calls"]:
            names_by_group.setdefault(ranks, set()).add(name)
        assert "all_reduce" in names_by_group[dp_pair]  # gradients over the stage's replicas
        assert "broadcast" in names_by_group[pipeline]  # the loss from the last stage
