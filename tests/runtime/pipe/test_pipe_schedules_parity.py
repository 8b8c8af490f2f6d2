"""Every pipeline schedule selectable by name (pipeline.schedule: "1f1b", "zb-h1",
"interleaved-1f1b") trains through the public API to the per-step losses of the same layers
trained without a pipeline in one process (plain torch: AdamW, WarmupLR, global-norm
clipping that binds), fp32 to 1e-5: at pp=2, at pp=4 with ZeRO-1, and at pp=2 x dp=2 with
ZeRO-1. The 2-rank job also runs GPT-lite (tuples and functions between layers) and a tied
embedding/head under ZB-H1, eval_batch through interleaved chunks, and the one-line
refusals of a schedule that does not exist or does not fit the module."""
import copy

import pytest
import torch

from dist_harness import run_function
from test_pipe_parity import (MICRO, TOL, config, global_batches, gptlite, gptlite_pair, pipeline_engine,
                              replica_iter, tied_reference, tied_specs, train_reference)

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")
STEPS = 2
WIDTH = 8


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def halve(x):
    return 0.5 * x


def mlp_layers(blocks=8):
    """Blocks with a function after every second one (a layer without weights)."""
    torch.manual_seed(0)
    out = []
    for i in range(blocks):
        out.append(Block())
        if i % 2:
            out.append(halve)
    return out


def mlp_batches(steps, dp, gas, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(MICRO, WIDTH, generator=g), torch.randint(0, WIDTH, (MICRO,), generator=g))
             for _ in range(dp * gas)] for _ in range(steps)]


def run_mlp(schedule, pp, dp, gas, zero):
    layers = mlp_layers()
    ref_layers = copy.deepcopy(layers)
    cfg = config(gas, zero=zero, pipeline={"schedule": schedule})
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    engine = pipeline_engine(layers, pp, cfg, partition_method="type:Block", virtual_stages=chunks)
    batches = mlp_batches(STEPS, dp, gas)
    it = replica_iter(batches, engine.grid.get_data_parallel_rank(), gas)
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    engine.destroy()
    params = torch.nn.ModuleList([m for m in ref_layers if isinstance(m, torch.nn.Module)])

    def forward(x):
        for f in ref_layers:
            x = f(x)
        return x
    return losses, train_reference(params, forward, batches, config(gas))


def _pp2_worker():
    from dslaunch.runtime.strict import ConfigError

    out = {}
    gas = 4
    for name in SCHEDULES:
        out[name] = run_mlp(name, 2, 1, gas, zero=0)
    # GPT-lite: a tuple (token and position embeddings) and functions between layers
    mod = gptlite()
    model, ref = gptlite_pair(mod)
    engine = pipeline_engine(model.to_layers(), 2, config(gas, pipeline={"schedule": "zb-h1"}))
    batches = global_batches(STEPS, 1, gas)
    it = replica_iter(batches, 0, gas)
    out["gptlite zb-h1"] = ([float(engine.train_batch(it)) for _ in range(STEPS)],
                            train_reference(ref, ref, batches, config(gas)))
    engine.destroy()
    # a weight tied across the two stages, used by a forward_fn on the second
    params, forward = tied_reference()
    engine = pipeline_engine(tied_specs(), 2, config(gas, pipeline={"schedule": "zb-h1"}), seed_layers=True,
                             partition_method="uniform")
    it = replica_iter(batches, 0, gas)
    out["tied zb-h1"] = ([float(engine.train_batch(it)) for _ in range(STEPS)],
                         train_reference(params, forward, batches, config(gas)))
    engine.destroy()
    # eval_batch through interleaved chunks: the untrained reference's loss
    layers = mlp_layers()
    ref_layers = copy.deepcopy(layers)
    engine = pipeline_engine(layers, 2, config(gas, pipeline={"schedule": "interleaved-1f1b"}),
                             partition_method="type:Block", virtual_stages=2)
    evals = mlp_batches(1, 1, gas, seed=9)[0]
    loss = float(engine.eval_batch(iter(evals)))
    with torch.no_grad():
        ref_eval = 0.0
        for x, y in evals:
            for f in ref_layers:
                x = f(x)
            ref_eval += float(torch.nn.functional.cross_entropy(x, y)) / gas
    out["eval interleaved"] = (loss, ref_eval)
    engine.destroy()
    refusals = []
    for schedule, chunks in (("gpipe", 1), ("interleaved-1f1b", 1), ("zb-h1", 2)):
        try:
            pipeline_engine(mlp_layers(), 2, config(gas, pipeline={"schedule": schedule}),
                            partition_method="type:Block", virtual_stages=chunks)
            refusals.append("no error")
        except ConfigError as exc:
            refusals.append(str(exc))
    out["refusals"] = refusals
    return out


@pytest.mark.timeout(400)
def test_schedules_at_pp2_match_unpipelined_training_and_refuse_in_one_line():
    results = run_function(_pp2_worker, nprocs=2, timeout=380)
    for r in results:
        for key in (*SCHEDULES, "gptlite zb-h1", "tied zb-h1"):
            got, ref = r[key]
            assert got == pytest.approx(ref, rel=TOL, abs=TOL), key
        loss, ref_eval = r["eval interleaved"]
        assert loss == pytest.approx(ref_eval, rel=TOL, abs=TOL)
        assert r["refusals"] == [
            "pipeline.schedule: unknown schedule 'gpipe'; valid: 1f1b, interleaved-1f1b, zb-h1",
            "pipeline.schedule: 'interleaved-1f1b' runs several model chunks per stage; build the PipelineModule "
            "with virtual_stages=2 or more",
            "pipeline.schedule: 'zb-h1' runs one model chunk per stage but the PipelineModule has virtual_stages=2; "
            "use \"interleaved-1f1b\" or virtual_stages=1"]


def _pp4_worker():
    return {name: run_mlp(name, 4, 1, 4, zero=1) for name in SCHEDULES}


@pytest.mark.timeout(500)
def test_schedules_at_pp4_with_zero1_match_unpipelined_training():
    for r in run_function(_pp4_worker, nprocs=4, timeout=480):
        for name in SCHEDULES:
            got, ref = r[name]
            assert got == pytest.approx(ref, rel=TOL, abs=TOL), name


def _pp2dp2_worker():
    return {name: run_mlp(name, 2, 2, 2, zero=1) for name in SCHEDULES}


@pytest.mark.timeout(500)
def test_schedules_at_pp2_x_dp2_with_zero1_match_unpipelined_training():
    for r in run_function(_pp2dp2_worker, nprocs=4, timeout=480):
        for name in SCHEDULES:
            got, ref = r[name]
            assert got == pytest.approx(ref, rel=TOL, abs=TOL), name
