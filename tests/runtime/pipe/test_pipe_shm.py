"""Pipeline stages on one host pass activations and gradients through shared-memory rings
(comm/shm_p2p.py), set up when the engine is built; stages that name different hosts, or a
job with DSLAUNCH_SHM_COMM=0, stay on gloo.

Two ranks, two stages, each schedule (1F1B, ZB-H1, interleaved 1F1B over 2 chunks): the
engine's flows are the ring-backed ones on one host and none otherwise, and the losses and
the trained weights are bit for bit those of the same run over gloo (the transport moves
bytes; nothing else changes). Every send of the same-host run is recorded on a ring.
"""
import os

from dist_harness import run_function

SCHEDULES = ("1f1b", "zb-h1", "interleaved-1f1b")


def _run(schedule):
    import torch

    import dslaunch.runtime as ds
    from dslaunch.runtime.pipe import PipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]
    net = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform",
                         virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "pipeline": {"schedule": schedule},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    engine, *_ = ds.initialize(model=net, config=cfg, model_parameters=[p for p in net.parameters()])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(8)]
    losses = [float(engine.train_batch(iter(data[4 * k:4 * k + 4]))) for k in range(2)]
    weights = [p.detach().clone() for p in net.parameters()]
    return engine.shared_memory_flows, losses, weights


def _worker():
    import torch

    from collectives import CollectiveRecorder
    from dslaunch.runtime import comm

    rank = comm.get_rank()
    out = {}
    for mode in ("gloo", "hosts", "shm"):
        os.environ["DSLAUNCH_SHM_COMM"] = "0" if mode == "gloo" else "1"
        if mode == "hosts":
            os.environ["NODE_RANK"] = str(rank)  # as the launcher sets it on two machines
        else:
            os.environ.pop("NODE_RANK", None)
        for schedule in SCHEDULES:
            rec = CollectiveRecorder().install()
            try:
                flows, losses, weights = _run(schedule)
            finally:
                rec.uninstall()
            p2p = [name for name, _, peer in rec.records if peer is not None]
            out[mode, schedule] = {"flows": flows, "losses": losses, "p2p": len(p2p), "ring": rec.ring_calls}
            out[mode, schedule, "weights"] = weights
    same = {(m, s): all(torch.equal(a, b) for a, b in zip(out["gloo", s, "weights"], out[m, s, "weights"]))
            for m in ("hosts", "shm") for s in SCHEDULES}
    return {"runs": {k: v for k, v in out.items() if len(k) == 2}, "same_weights": same}


def test_same_host_stages_use_rings_and_train_bit_for_bit_as_over_gloo():
    results = run_function(_worker, nprocs=2, timeout=420)
    for rank, r in enumerate(results):
        runs = r["runs"]
        for s in SCHEDULES:
            gloo, hosts, shm = runs["gloo", s], runs["hosts", s], runs["shm", s]
            assert gloo["flows"] == [] and hosts["flows"] == [], (rank, s)
            assert shm["flows"] and all(a != b for a, b, _ in shm["flows"]), (rank, s)
            assert {(a, b) for a, b, _ in shm["flows"]} == {(0, 1), (1, 0)}, (rank, s)
            assert shm["losses"] == gloo["losses"] == hosts["losses"], (rank, s)
            assert r["same_weights"]["hosts", s] and r["same_weights"]["shm", s], (rank, s)
            assert shm["p2p"] == gloo["p2p"] == hosts["p2p"] > 0, (rank, s)  # the same sends and receives
            assert shm["ring"] == shm["p2p"] and gloo["ring"] == hosts["ring"] == 0, (rank, s)
