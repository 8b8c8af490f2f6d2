"""ZeRO-3 gathers ahead of use, asynchronously (runtime/zero/prefetch.py), on 2 gloo ranks.

Once the first forward has recorded the module order, each module's pre-hook starts the
all-gathers of the modules after it (in backward: before it) as async collectives, up to
stage3_prefetch_bucket_size elements ahead of use, and only the first module of each phase
waits for a gather it started itself. Checked through the engine on a chain of linears:
- which gathers are async, and that the elements ahead of use never exceed the bucket;
- losses equal to the same run with prefetching off (bucket 0): the same arithmetic;
- a forward that stops early, and a no_grad forward, leave no gather behind: after every
  step only shards remain;
- with offload_param nvme, the shards of the next modules are read from their files ahead
  of use in backward as in forward (the swapper counts reads that waited on the file).
"""
from dist_harness import run_function

WIDTH, LAYERS = 64, 6
LAYER = WIDTH * WIDTH + WIDTH  # elements per linear


def _train(prefetch, depths=(LAYERS,) * 4, eval_first=False, nvme=None):
    import torch

    import dslaunch.runtime as deepspeed
    from dslaunch.runtime.zero import params as zparams

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

        def forward(self, x, depth=LAYERS):
            for layer in self.layers[:depth]:
                x = torch.tanh(layer(x))
            return x

    torch.manual_seed(0)
    model = Chain()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": prefetch,
            "stage3_max_reuse_distance": 0}  # every module released after its forward: backward gathers too
    if nvme:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme}
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": zero}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    z3 = engine.strategy
    events, ahead = [], []
    real = zparams.comm.all_gather_into_tensor

    def logged(out, inp, *a, **kw):
        events.append("async" if kw.get("async_op") else "sync")
        return real(out, inp, *a, **kw)

    zparams.comm.all_gather_into_tensor = logged
    for layer in model.layers:  # after the engine's hooks: what this module's pre-hook started counts
        layer.register_forward_hook(lambda m, a, o: ahead.append(sum(z3._prefetch.unused.values())))
    torch.manual_seed(1 + torch.distributed.get_rank())
    if eval_first:
        with torch.no_grad():
            engine(torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(7)))  # the data stream unchanged
    losses, phases, at_rest, reads = [], [], [], []
    sw = z3.swapper
    for depth in depths:
        events.clear()
        before = (sw.reads_on_demand, sw.reads_ahead) if sw else None
        loss = engine(torch.randn(4, WIDTH), depth).pow(2).mean()
        fwd = list(events)
        mid = (sw.reads_on_demand, sw.reads_ahead) if sw else None
        engine.backward(loss)
        engine.step()
        if sw:
            sw.flush()  # the step's shard writes done: every later read comes from a file, counted
        phases.append((fwd, events[len(fwd):]))
        losses.append(float(loss))
        at_rest.append(sum(p.data.numel() for p in model.parameters()))
        if sw:
            after = (sw.reads_on_demand, sw.reads_ahead)
            reads.append(((mid[0] - before[0], mid[1] - before[1]), (after[0] - mid[0], after[1] - mid[1])))
    zparams.comm.all_gather_into_tensor = real
    return {"losses": losses, "phases": phases, "ahead": max(ahead), "at_rest": at_rest, "reads": reads}


def _cases(tmp):
    import os

    runs = {"off": _train(0), "two": _train(2 * LAYER + 10), "short": _train(2 * LAYER + 10, (6, 3, 6, 6)),
            "short_off": _train(0, (6, 3, 6, 6)), "eval": _train(2 * LAYER + 10, eval_first=True)}
    nvme = os.path.join(tmp, f"rank{__import__('torch').distributed.get_rank()}")
    os.makedirs(nvme, exist_ok=True)
    runs["nvme"] = _train(2 * LAYER + 10, nvme=nvme)
    runs["nvme_off"] = _train(0, nvme=nvme)
    return runs


def test_prefetch_is_async_bounded_and_changes_no_arithmetic(tmp_path):
    out = run_function(_cases, nprocs=2, kwargs={"tmp": str(tmp_path)}, timeout=300)[0]
    off, two = out["off"], out["two"]
    assert two["losses"] == off["losses"] and out["eval"]["losses"] == off["losses"]
    assert out["short"]["losses"] == out["short_off"]["losses"]
    # without prefetching every module waits for its own gather, forward and backward
    assert off["phases"][2] == (["sync"] * LAYERS, ["sync"] * LAYERS)
    # step 0 records the order; then only the first module of each phase gathers for itself
    assert two["phases"][0][0] == ["sync"] * LAYERS
    # (the first window's two modules, smaller than MIN_COLLECTIVE, share one collective)
    assert two["phases"][0][1] == ["sync"] + ["async"] * (LAYERS - 2)
    for fwd, bwd in two["phases"][1:]:
        assert fwd == bwd == ["sync"] + ["async"] * (LAYERS - 2), (fwd, bwd)
    assert 0 < two["ahead"] <= 2 * LAYER + 10  # elements gathered ahead of use stay within the bucket
    # a forward that stopped at layer 3 dropped the gathers it had started for layers 4-5
    for run in out.values():
        assert run["at_rest"] == [0] * len(run["at_rest"])
    # nvme: after the recording step, backward reads every shard (weight and bias of each layer)
    # from its file ahead of use; forward waits on the files of its first module and of the
    # first prefetch window only (with prefetching off, backward waited on nearly every file)
    for (fwd_demand, fwd_ahead), (bwd_demand, bwd_ahead) in out["nvme"]["reads"][1:]:
        assert (bwd_demand, bwd_ahead) == (0, 2 * LAYERS) and fwd_demand <= 6 and fwd_ahead >= LAYERS
    assert all(bwd_demand >= LAYERS for _, (bwd_demand, _) in out["nvme_off"]["reads"][1:])
    assert out["nvme"]["losses"] == out["nvme_off"]["losses"] == off["losses"]
