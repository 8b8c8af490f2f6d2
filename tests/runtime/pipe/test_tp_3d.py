"""The seed's GPT-lite in 3D (scripts/examples/gptlite_3d.py): tensor-parallel blocks built
from the public layer classes, cut into pipeline stages, ZeRO on the data axis. pp=2 x tp=2
on 4 ranks and pp=2 x tp=2 x dp=2 with ZeRO-1 on 8 ranks train with the per-step losses of
the same GPT-lite trained in plain torch without any parallelism (test_pipe_parity's
reference: AdamW, WarmupLR, global-norm clipping that binds), to 1e-5 in fp32. The 4-rank job
also counts its collectives per process group: the tensor all-reduces run on the tensor
groups only, gradients on the data groups, activations between the pipeline's stages.
"""
import importlib.util
import os

import torch

from dist_harness import run_function
from test_pipe_parity import config, global_batches, replica_iter, train_reference
import repo_paths

ROOT = str(repo_paths.ROOT)
EXAMPLE = os.path.join(ROOT, "scripts", "examples", "gptlite_3d.py")
STEPS = 3
TOL = 1e-5


def example():
    """The 3D example module, its GPT-lite shrunk (2 blocks of width 16, 2 heads, 8 tokens)."""
    spec = importlib.util.spec_from_file_location("gptlite_3d_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.lite.n_layer, mod.lite.n_embd, mod.lite.n_head, mod.lite.block_size = 2, 16, 2, 8
    return mod


def run_3d(pp, tp, zero, count=False):
    import dslaunch.runtime as deepspeed
    from collectives import CollectiveRecorder

    mod = example()
    torch.manual_seed(0)
    ref = mod.lite.GPTlite()  # what build() makes from the same seed, before any split
    gas = 2
    cfg = config(gas, zero=zero)
    net = mod.build(pp, tp)
    engine, _, _, _ = deepspeed.initialize(model=net, config=cfg)
    dp = engine.mesh.size("data")
    batches = global_batches(STEPS, dp, gas)
    it = replica_iter(batches, engine.mesh.rank("data"), gas)
    rec = CollectiveRecorder().install() if count else None
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    groups = None
    if rec is not None:
        rec.uninstall()
        groups = sorted({(name, ranks if peer is None else (peer,)) for name, ranks, peer in rec.records})
    layout = {a: engine.mesh.ranks(a) for a in ("tensor", "data", "pipe")}
    engine.destroy()
    return losses, train_reference(ref, ref, batches, cfg), layout, groups


def _check(results):
    for losses, ref, _, _ in results:
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, ref)) < TOL, (losses, ref)


def test_pp2_by_tp2_on_four_ranks_matches_unparallelised_training():
    results = run_function(run_3d, nprocs=4, kwargs=dict(pp=2, tp=2, zero=0, count=True), timeout=400)
    _check(results)
    # DeepSpeed's order: tensor ranks adjacent, stages furthest apart
    assert [r[2]["tensor"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[2]["pipe"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # every collective on its axis's group: all-reduces on the tensor group (the blocks, all on
    # stage 0 here) or the replica (the global norm; data is 1 here), activations to the other stage
    for rank, (_, _, layout, ops) in enumerate(results):
        reduces = {ranks for name, ranks in ops if name == "all_reduce"}
        assert reduces <= {tuple(layout["tensor"]), (0, 1, 2, 3)}, ops
        assert (tuple(layout["tensor"]) in reduces) == (rank in (0, 1)), ops
        peers = {ranks for name, ranks in ops if name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")}
        assert peers and all(set(p) <= set(layout["pipe"]) or p == (0, 1, 2, 3) for p in peers), ops


def test_pp2_by_tp2_by_dp2_zero1_on_eight_ranks_matches_unparallelised_training():
    results = run_function(run_3d, nprocs=8, kwargs=dict(pp=2, tp=2, zero=1), timeout=600)
    _check(results)
    assert results[5][2] == {"tensor": [4, 5], "data": [5, 7], "pipe": [1, 5]}
